"""Weights in safetensors with HF tensor names: load (strict, with named errors) and save."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names each offending tensor."""


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


@torch.no_grad()
def load_weights(model: DeepseekV41ForCausalLM, path: str | Path) -> None:
    """Load every parameter and buffer from safetensors at ``path`` (a file or a directory).

    Refuses (before copying anything) a missing tensor, an unexpected tensor, or a tensor whose
    shape differs, naming the tensor and both shapes. Values are cast to the model's dtypes.
    """
    path = Path(path)
    expected = dict(model.state_dict())
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in _files(path):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                found[name] = (f, tuple(sf.get_slice(name).get_shape()))
    problems = []
    for name in sorted(set(expected) - set(found)):
        problems.append(f"missing tensor {name} (model expects shape {list(expected[name].shape)})")
    for name in sorted(set(found) - set(expected)):
        problems.append(
            f"unexpected tensor {name} with shape {list(found[name][1])} in {found[name][0].name}"
        )
    for name in sorted(set(found) & set(expected)):
        if found[name][1] != tuple(expected[name].shape):
            problems.append(
                f"tensor {name} has shape {list(found[name][1])} in the checkpoint, "
                f"the model expects {list(expected[name].shape)}"
            )
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise WeightLoadError(f"checkpoint {path} does not fit the model: {shown}{more}")
    by_file: dict[Path, list[str]] = {}
    for name, (f, _) in found.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                target = expected[name]
                target.copy_(sf.get_tensor(name).to(device=target.device, dtype=target.dtype))


def save_weights(model: DeepseekV41ForCausalLM, directory: str | Path) -> Path:
    """Write config.json and model.safetensors into ``directory``; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # clone: expert weights may be views of one stacked tensor (safetensors refuses shared storage)
    tensors = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    return directory
