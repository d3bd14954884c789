"""Multi-GPU loading reads only each rank's part of a checkpoint: a parameter the engine stacks
from several stored tensors (q/k/v, a bias, experts one by one or packed with a shared expert),
cut before it is read, equals the same cut of the parameter read whole."""

import pytest
import torch
from safetensors.torch import save_file

from dflash_trt.weights import Checkpoint, Stacked

E, I, H = 3, 4, 5
PARTS = {
    "qkv": (["q", "k", "v"], (10, H)),
    "bias": (["bq", "bk"], (8,)),
    "experts packed with a shared one": (["packed", "shared_gate", "shared_up"], (E + 1, 2 * I, H)),
    "experts one by one": ([f"e{e}.{p}" for e in range(E) for p in ("gate", "up")], (E, 2 * I, H)),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (6, H), "k": (2, H), "v": (2, H), "bq": (6,), "bk": (2,), "packed": (E, 2 * I, H),
              "shared_gate": (I, H), "shared_up": (I, H),
              **{f"e{e}.{p}": (I, H) for e in range(E) for p in ("gate", "up")}}
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    directory = tmp_path_factory.mktemp("parts")
    save_file(tensors, str(directory / "model.safetensors"))
    return Checkpoint(directory), tensors


@pytest.mark.parametrize("kind", PARTS)
def test_every_narrowing_of_a_stacked_parameter_reads_what_the_whole_one_holds(stored, kind):
    checkpoint, tensors = stored
    names, shape = PARTS[kind]
    width = [shape[-1]] if len(shape) > 1 else []
    whole = torch.cat([tensors[n].reshape(-1, *width) for n in names]).view(shape)
    lazy = Stacked([checkpoint.unread(n) for n in names], shape)
    for dim, size in enumerate(shape):
        for start in range(size):
            for length in range(1, size - start + 1):
                assert torch.equal(lazy.narrow(dim, start, length), whole.narrow(dim, start, length)), (dim, start)
    corner = tuple(slice(1, n - 1) for n in shape)  # every dim cut at once, columns included
    assert torch.equal(lazy[corner], whole[corner])
