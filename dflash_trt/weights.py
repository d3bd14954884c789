"""Safetensors checkpoints in the Hugging Face layout, loaded into models that keep HF names.

safetensors only: no pickle, no remote code. Fused parameters (`PackedLinear`) declare
which checkpoint tensors they stack, so a checkpoint is read as it is, with no conversion;
so do the packed MoE experts (`Experts`) for checkpoints that store one tensor per expert.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from dflash_trt.errors import CheckpointError
from dflash_trt.models.layers import PackedLinear
from dflash_trt.models.moe import Experts

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """Tensor names of one checkpoint directory, each mapped to the file that holds it."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}
        self.files = self._tensor_files()

    def _tensor_files(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
            return {name: self.directory / file for name, file in weight_map.items()}
        single = self.directory / SINGLE_FILE
        if not single.exists():
            raise CheckpointError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} found")
        return {name: single for name in self._open(single).keys()}

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.exists():
                raise CheckpointError(f"{path}: weight file listed in the checkpoint is missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from None
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        """A stored tensor's shape, without reading it."""
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        try:
            return self._open(path).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({e})") from None

    def unread(self, name: str) -> "Unread":
        """A stored tensor to cut before reading: indexing it reads only the part kept."""
        return Unread(self, name)

    def resolve(self, name: str, prefixes: tuple[str, ...]) -> str:
        """The stored name of model tensor `name`, trying each allowed prefix."""
        for prefix in prefixes:
            for stored in (prefix + name, _in_language_model(prefix + name)):
                if stored in self.files:
                    return stored
        raise CheckpointError(f"{self.directory}: tensor '{prefixes[0] + name}' is missing from the checkpoint")


class _Lazy:
    """What a cut may call on a tensor not read yet, besides indexing with slices."""

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self[(slice(None),) * dim + (slice(start, start + length),)]


class Unread(_Lazy):
    """A checkpoint tensor not read yet, for a tensor-parallel cut (parallel.plan) or FSDP's
    split to narrow or index: only the rows or columns the rank keeps leave the file, not the
    whole tensor (each rank of a model split N ways would otherwise read all of it)."""

    def __init__(self, checkpoint: Checkpoint, name: str):
        self.checkpoint, self.name = checkpoint, name
        self.shape = checkpoint.shape(name)

    def __getitem__(self, index) -> torch.Tensor:
        path = self.checkpoint.files[self.name]
        try:
            return self.checkpoint._open(path).get_slice(self.name)[index]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor '{self.name}' ({e})") from None


class Stacked(_Lazy):
    """A parameter the engine stacks by rows from several stored tensors (q/k/v, gate/up, the
    experts one by one or packed with a shared expert), not read yet: indexing reads from each
    only the rows and columns it selects. Rows are the parameter's flattened leading dims (a
    1-D one's elements), as load_weights stacks them."""

    def __init__(self, parts: list[Unread], shape: tuple[int, ...]):
        self.parts, self.shape = parts, shape
        self.flat = len(shape) == 1
        self.sizes = [math.prod(p.shape) if self.flat else math.prod(p.shape[:-1]) for p in parts]

    def __getitem__(self, index) -> torch.Tensor:
        index = (index if isinstance(index, tuple) else (index,)) + (slice(None),) * len(self.shape)
        spans = [range(*where.indices(n)) for where, n in zip(index, self.shape)]
        assert all(span.step == 1 for span in spans), index
        lead, cols = (spans, None) if self.flat else (spans[:-1], index[len(self.shape) - 1])
        strides = [math.prod(self.shape[d + 1:len(lead)]) for d in range(len(lead))]  # flat rows per index
        pieces = []
        for outer in itertools.product(*lead[:-1]):  # a run of rows for each index of the dims before the last
            base = sum(i * stride for i, stride in zip(outer, strides))
            pieces += self._rows(base + lead[-1].start, base + lead[-1].stop, cols)
        out = torch.cat(pieces)
        return out.view(*map(len, lead), *out.shape[1:])

    def _rows(self, start: int, stop: int, cols) -> list[torch.Tensor]:
        """Flat rows start..stop-1 (their `cols`), from the parts that hold them."""
        pieces, offset = [], 0
        for part, size in zip(self.parts, self.sizes):
            lo, hi = max(start, offset) - offset, min(stop, offset + size) - offset
            if lo < hi:
                if self.flat:
                    pieces.append(part[lo:hi])
                elif len(part.shape) == 2:
                    pieces.append(part[lo:hi, cols])
                else:  # a packed [experts, rows, width] part: its rows expert by expert
                    inner = part.shape[1]
                    for e in range(lo // inner, (hi - 1) // inner + 1):
                        pieces.append(part[e, max(lo - e * inner, 0):min(hi - e * inner, inner), cols])
            offset += size
        return pieces


def _one_expert_part(param_name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """The shape of one stored tensor of one expert in an Experts parameter [E, rows, width]:
    gate or up (half of gate_up's rows), or down."""
    return shape[1] // (2 if param_name.endswith("gate_up_proj") else 1), shape[2]


def _unread_parameter(module: nn.Module, param_name: str, shape: tuple[int, ...],
                      parts: list[Unread]) -> "Unread | Stacked | None":
    """The stored parts of a parameter as one tensor to cut before reading, or None if they do
    not fit it (load_weights then reads them whole and names the misfit)."""
    if len(parts) == 1:
        return parts[0] if parts[0].shape == shape else None
    if isinstance(module, Experts):  # packed [experts, rows, width], or one projection of an expert
        one = _one_expert_part(param_name, shape)
        fits = all(len(p.shape) == 3 and p.shape[1:] == shape[1:] or p.shape == one for p in parts)
    else:
        fits = all(p.shape[1:] == shape[1:] for p in parts) and sum(p.shape[0] for p in parts) == shape[0]
    fits = fits and sum(math.prod(p.shape) for p in parts) == math.prod(shape)
    return Stacked(parts, shape) if fits else None


def _in_language_model(name: str) -> str:
    """Multimodal checkpoints (Qwen3.5/3.6) keep the text model's "model.X" as
    "model.language_model.X"; the runtime models use the text-only names."""
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def _sources(module: nn.Module, param_name: str, checkpoint: Checkpoint, prefixes: tuple[str, ...]) -> list[str]:
    """Checkpoint tensor names that make up one model parameter, in stacking order.

    An engine directory stores fused tensors under the parameter's own name; a Hugging Face
    checkpoint stores the separate projections that a PackedLinear stacks.
    """
    owner, _, leaf = param_name.rpartition(".")
    if isinstance(module, Experts):
        return _expert_sources(module, owner, leaf, checkpoint, prefixes)
    if _stored_whole(param_name, checkpoint, prefixes):
        return [param_name]
    if isinstance(module, PackedLinear):
        base = owner.rpartition(".")[0]
        return [f"{base}.{shard}.{leaf}".lstrip(".") for shard in module.shards]
    return [param_name]


def _expert_sources(module: Experts, owner: str, leaf: str, checkpoint: Checkpoint,
                    prefixes: tuple[str, ...]) -> list[str]:
    """The routed experts packed (an engine directory, Qwen3.5 MoE) or one tensor per expert
    (Qwen3 MoE), then, where the module packs the shared expert as one more, its tensors."""
    whole = f"{owner}.{leaf}"
    shards = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    if _stored_whole(whole, checkpoint, prefixes):
        if checkpoint.shape(checkpoint.resolve(whole, prefixes))[0] == module.num_experts + module.shared:
            return [whole]  # an engine directory: the shared expert is packed in already
        sources = [whole]
    else:
        sources = [f"{owner}.{e}.{shard}.weight" for e in range(module.num_experts) for shard in shards]
    if module.shared:
        sources += [f"{owner.rpartition('.')[0]}.shared_expert.{shard}.weight" for shard in shards]
    return sources


def _stored_whole(name: str, checkpoint: Checkpoint, prefixes: tuple[str, ...]) -> bool:
    return any(p + name in checkpoint or _in_language_model(p + name) in checkpoint for p in prefixes)


def load_weights(model: nn.Module, checkpoint: Checkpoint, prefixes: tuple[str, ...] = ("",),
                 skip: tuple[str, ...] = (), cuts: dict | None = None, device=None) -> None:
    """Fill every parameter of `model` from `checkpoint`, checking shapes; extra tensors are ignored.

    With `cuts` (a tensor-parallel rank's, parallel.plan), each parameter is cut to this rank's
    shard and set anew on `device`, so the model may be on "meta"; a parameter FSDP shards keeps
    its rows. Either way its stored tensors are cut before they are read (Unread, Stacked): a
    rank reads its part of the checkpoint, not all of it."""
    modules = dict(model.named_modules())
    for param_name, param in model.named_parameters():
        if param_name in skip:
            continue
        module = modules[param_name.rpartition(".")[0]]
        parts = []
        sources = _sources(module, param_name, checkpoint, prefixes)
        if cuts is not None and param_name in cuts or _fsdp_rows(param) is not None:  # cut before reading
            unread = _unread_parameter(module, param_name, tuple(param.shape),
                                       [checkpoint.unread(checkpoint.resolve(s, prefixes)) for s in sources])
            if unread is not None:
                if cuts is not None:
                    set_parameter(model, param_name, cuts[param_name](unread).to(device, param.dtype))
                else:
                    with torch.no_grad():
                        param.copy_(_own_rows(param, unread))
                continue
        for source in sources:
            stored = checkpoint.resolve(source, prefixes)
            parts.append(checkpoint.get(stored))
        stacked = True
        if isinstance(module, Experts) and len(parts) > 1:  # experts' rows one after the other
            one = _one_expert_part(param_name, tuple(param.shape))
            stacked = all(p.dim() == 3 or tuple(p.shape) == one for p in parts)  # each expert's own shape
            parts = [p.reshape(-1, p.shape[-1]) for p in parts]
        stacked = stacked and all(p.shape[1:] == parts[0].shape[1:] for p in parts)  # else cat cannot stack
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 and stacked else parts[0]
        if isinstance(module, Experts) and stacked and tensor.numel() == param.numel():
            tensor = tensor.view(param.shape)
        if not stacked or tuple(tensor.shape) != tuple(param.shape):
            shapes = ", ".join(f"{s}{tuple(p.shape)}" for s, p in zip(sources, parts) if p.shape != parts[0].shape
                               or s == sources[0])
            raise CheckpointError(
                f"{checkpoint.files[checkpoint.resolve(sources[0], prefixes)]}: "
                f"tensor {shapes} does not fit parameter '{param_name}' of shape {tuple(param.shape)}"
            )
        if cuts is not None:
            set_parameter(model, param_name, cuts.get(param_name, lambda t: t)(tensor).to(device, param.dtype))
            continue
        with torch.no_grad():
            param.copy_(_own_part(param, tensor))


def _fsdp_rows(param: torch.Tensor) -> slice | None:
    """The rows this rank keeps of a parameter FSDP shards by rows (torch.chunk's split of dim
    0, as fully_shard makes it), or None for any other parameter."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
        return None
    n, mesh = param.shape[0], param.device_mesh
    per = -(-n // mesh.size())
    rank = mesh.get_local_rank()
    return slice(min(rank * per, n), min((rank + 1) * per, n))


def _own_rows(param: torch.Tensor, stored: "Unread | Stacked") -> torch.Tensor:
    """An FSDP parameter's part of a stored tensor, only its rows read, as the DTensor `param` is."""
    from torch.distributed.tensor import DTensor

    rows = _fsdp_rows(param)
    local = (stored[rows] if rows.stop > rows.start else torch.empty((0, *param.shape[1:])))
    return DTensor.from_local(local.to(param.device, param.dtype), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def _own_part(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as `param` holds it: for a parameter sharded by FSDP (a DTensor), this rank's
    part of it, cut here from the whole tensor every rank read (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return tensor
    return distribute_tensor(tensor.to(param.device, param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor.contiguous(), requires_grad=False))


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """save_file, then the mode any new file gets (0666 less the umask): safetensors writes its
    files 0600, which a server or a colleague running as another user cannot read."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1,
                      dtype: torch.dtype | None = None) -> None:
    tensors = {name: (t.to(dtype) if dtype else t).contiguous() for name, t in tensors.items()}
    if num_shards == 1:
        _save(tensors, directory / "model.safetensors")
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        _save(part, directory / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
