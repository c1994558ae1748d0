"""The loops of a decoding step over logits and trees (`StepKernels`), chosen once per device: C++ where the logits
are in CPU memory and the loops are built (decode/native), the portable code elsewhere."""
import torch

from decode import native
from decode.kernels.base import StepKernels
from decode.kernels.cpp import NativeKernels
from decode.kernels.portable import PortableKernels

__all__ = ["NativeKernels", "PortableKernels", "StepKernels", "kernels_for"]


def kernels_for(device: torch.device | str = "cpu") -> StepKernels:
    """The kernels for a model's logits on `device` (the trigram's trees and the context's continuations: "cpu")."""
    if torch.device(device).type == "cpu" and native.module() is not None:
        return NativeKernels()
    return PortableKernels()
