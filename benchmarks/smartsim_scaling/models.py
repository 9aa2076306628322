"""Models for the inference test, built from code with random weights, and the preprocessing script.

``resnet50`` is torchvision's ResNet-50 architecture (bottleneck blocks 3-4-6-3, 1000 classes)
written out here so that no torchvision is needed; ``cnn`` is a small convolutional net with the
same input and output shapes that keeps a CPU run short.
"""

from __future__ import annotations

import functools
import io
import warnings

import torch
from torch import nn

from benchmarks.smartsim_scaling.options import NUM_CLASSES


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width = planes
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
            if stride != 1 or inplanes != out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + self.downsample(x))


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(blocks):
                layers.append(Bottleneck(inplanes, planes, stride if b == 0 else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


def small_cnn(num_classes: int = NUM_CLASSES) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )


MODELS = {"cnn": small_cnn, "resnet50": ResNet50}


MAX_BATCH = 4096  # largest batch an exported model takes (its batch dimension is dynamic up to this)


@functools.lru_cache(maxsize=4)
def exported_bytes(name: str, image_size: int, seed: int = 0) -> bytes:
    """The model ``name`` with seeded random weights as a ``torch.export`` archive (what ``set_model`` takes).

    The batch dimension is exported as dynamic, so that the workers can batch requests.
    """
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    example = torch.zeros(2, 3, image_size, image_size)
    program = torch.export.export(model, (example,),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def model_bytes(name: str, image_size: int, model_format: str = "export") -> bytes:
    """The model as ``torch.export`` (``export``) or TorchScript (``torchscript``) bytes."""
    return exported_bytes(name, image_size) if model_format == "export" else torchscript_bytes(name)


@functools.lru_cache(maxsize=4)
def torchscript_bytes(name: str, seed: int = 0) -> bytes:
    """The model ``name`` with seeded random weights, scripted on CPU, as the bytes ``set_model`` takes."""
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # TorchScript is what set_model(..., "TORCH") takes, as RedisAI did; torch now says it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(model), buffer)
    return buffer.getvalue()
