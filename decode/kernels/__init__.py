"""The loops of a decoding step over logits and trees (`StepKernels`): C++ where the logits are in CPU memory and the
loops are built (decode/native), the portable code elsewhere. A model's runtime (decode.models.runtime) chooses."""
from decode.kernels.base import StepKernels
from decode.kernels.cpp import NativeKernels
from decode.kernels.portable import PortableKernels

__all__ = ["NativeKernels", "PortableKernels", "StepKernels"]
