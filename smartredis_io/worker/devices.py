"""Which torch device a model or script runs on, from the device it was set for and the worker's own.

A model set for ``CPU`` runs on the CPU; one set for ``GPU`` on the worker's device (``--device``) if
that is a GPU, else on GPU 0; one set for ``GPU:<i>`` (``set_model_multigpu``) on GPU ``i``. Where the
GPU asked for does not exist (a machine without GPUs, or fewer of them) the model runs on the
worker's device instead, with a warning, so code written for a GPU cluster still runs on a laptop.
"""

from __future__ import annotations

import torch

__all__ = ["model_device"]


def model_device(device: str, default: torch.device, gpus: int | None = None) -> tuple[torch.device, str]:
    """The device a model set for ``device`` runs on here, and a warning ("" when it is the one asked for)

    :param device: the device the model was set for: ``CPU``, ``GPU`` or ``GPU:<i>``
    :param default: the worker's device
    :param gpus: how many CUDA devices there are (default: ``torch.cuda.device_count()``)
    """
    name = device.upper()
    if name.startswith("CPU"):
        return torch.device("cpu"), ""
    count = torch.cuda.device_count() if gpus is None else gpus
    index_text = name[len("GPU:"):] if name.startswith("GPU:") else ""
    if not index_text:
        if default.type == "cuda":
            return default, ""
        if count:
            return torch.device("cuda", 0), ""
        return default, f"it was set for {device} but this machine has no GPU: it runs on {default}"
    index = int(index_text) if index_text.isdigit() else -1
    if 0 <= index < count:
        return torch.device("cuda", index), ""
    where = f"this machine has {count} GPU(s)" if count else "this machine has no GPU"
    return default, f"it was set for {device} but {where}: it runs on {default}"
