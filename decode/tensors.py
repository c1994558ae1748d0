"""Small tensor helpers every layer uses: cheap int64 tensors, a device move without a call on the CPU."""
import numpy as np
import torch


def on(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` (on the CPU) moved to `device`, without a call when it is the CPU: a torch call right
    after a model's forward costs tens of microseconds on a CPU (its code and data were evicted)."""
    return tensor if device is None or getattr(device, "type", device) == "cpu" else tensor.to(device)


def long_tensor(values: list[int], device=None) -> torch.Tensor:
    """A 1-d int64 tensor from a list of ints: through numpy, which costs a fraction of torch.tensor's parsing of a
    list, and a decoding step makes several."""
    return on(torch.from_numpy(np.array(values, np.int64)), device)


Ids = list[int] | torch.Tensor  # a forward's tokens or positions: a 1-d int64 tensor, or a list (cheaper to make)


def as_tensor(values: Ids, device=None) -> torch.Tensor:
    """A forward's tokens or positions as a tensor on `device`."""
    return long_tensor(values, device) if isinstance(values, list) else values


def as_list(values: Ids) -> list[int]:
    return values if isinstance(values, list) else values.tolist()
