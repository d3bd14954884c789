"""A torch op of the plugins called wrongly raises a RuntimeError that names what is wrong, with
its numbers, sizes and dtypes in the message, and the process lives on. On the GPU machine's
torch a check whose message streamed a number crashed the process instead (plugins/ops.cpp,
DFLASH_CHECK): every case here has such a message (cuda marker; the ops exist there only)."""

import pytest
import torch

from dflash_trt import ops, plugins

BF16 = dict(dtype=torch.bfloat16, device="cuda")


def cases():
    return {
        "a row width": (lambda: torch.ops.dflash.rms_norm(torch.ones(1, 32, **BF16), torch.ones(64, **BF16), 1e-6),
                        r"H = 64, got \[1, 32\]"),
        "a matmul's shapes": (lambda: torch.ops.dflash.gemv(torch.ones(2, 64, **BF16), torch.ones(3, 32, **BF16)),
                              r"got \[2, 64\] and \[3, 32\]"),
        "a count": (lambda: torch.ops.dflash.moe_sort(torch.zeros(4, 2, dtype=torch.int32, device="cuda"), 0),
                    rf"num_experts must be in \[1, {ops.MOE_MAX_EXPERTS}\]"),
        "a dtype": (lambda: torch.ops.dflash.moe_route(torch.ones(2, 8, dtype=torch.float64, device="cuda"), 2, True,
                                                       False), "got Double"),
    }


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(cases()))
def test_a_wrong_call_raises_with_its_numbers_in_the_message(case):
    assert plugins.load() is not None, "the plugins did not build"
    call, message = cases()[case]
    with pytest.raises(RuntimeError, match=message):
        call()
    # the device still works after the error
    assert torch.ones(4, device="cuda").sum().item() == 4
