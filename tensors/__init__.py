"""The torch side shared by engines and trainer: the packed weight format (`packing`: pack,
unpack, digest), a version as a delta against another (`delta`), digests computed on the
tensors' own device (`checksums`: checksum, device_digest), host->device staging (`staging`),
the collective group weights are broadcast over (`collective`), and the model builder
(`models`).

`rlfabric.schemas` and `rlfabric.bus` never import torch; what needs it lives here. The names
below are loaded on first use, so importing `rlfabric.tensors.errors` costs no torch.
"""

from typing import Any

_WHERE = {
    "CollectiveGroup": "collective",
    "CollectiveTimeout": "errors",
    "DeltaRefused": "errors",
    "build_model": "models",
    "checksum": "checksums",
    "device_digest": "checksums",
    **{name: "packing" for name in ("buffer_size", "digest", "pack_buffer", "pack_file",
                                     "pack_into", "plan", "unpack")},
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"rlfabric.tensors.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rlfabric.tensors' has no attribute {name!r}")


__all__ = sorted(_WHERE)
