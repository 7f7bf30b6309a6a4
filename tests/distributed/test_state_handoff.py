"""The cp state hand-off of recurrent blocks (``distributed/state_handoff.py``): the cache it
gives a block, the generate-time check that picks the blocks it fits
(``planning/handoff_check.py``), and the transport:
three cp ranks (threads of one process, real collectives and point-to-point sends) each
running a transformers gated delta-net on its piece must give the whole sequence's output
and, summed over the ranks, every parameter's gradient (fp32)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyper_parallel.distributed.state_handoff import CONV, HandOffCache, install_state_handoff
from hyper_parallel.planning.handoff_check import handoff_check
from tests.threaded_world import run_ranks as _run_ranks

TOKENS, HIDDEN = 12, 32


def _gated_delta_net():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    block = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # A_log and dt_bias start as constants: make every head different
        for param in block.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return block


def _stream():
    return torch.randn(2, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


def test_conv_inputs_handed_on_reach_back_over_short_pieces():
    """Pieces of 2 tokens under a kernel of 4: each piece's convolution sees the 3 inputs
    before it, two of them from the piece before the previous one."""
    channels, kernel = 3, 4
    x = torch.randn(1, channels, 8)
    weight = torch.randn(channels, 1, kernel)
    whole = F.conv1d(x, weight, padding=kernel - 1, groups=channels)[..., :8]
    handed, pieces = {}, []
    for start in range(0, 8, 2):
        cache = HandOffCache(lambda given=handed: given)
        full = cache.update_conv_state(x[..., start:start + 2], 0, conv_kernel_size=kernel)
        out = F.conv1d(full, weight, padding=kernel - 1, groups=channels)[..., :full.shape[-1]]
        pieces.append(out[..., -2:])
        handed = cache.outgoing
        assert cache.outgoing[(CONV, 0)].shape[-1] == kernel - 1
    torch.testing.assert_close(torch.cat(pieces, dim=-1), whole, rtol=0, atol=1e-6)


def test_check_passes_a_gated_delta_net():
    assert handoff_check(_gated_delta_net(), (_stream(),), {}, 0) == ""


class _CumulativeIgnoringCache(nn.Module):
    """A recurrence (a running sum) that takes a cache but never reads it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, cache=None):
        return self.proj(hidden_states).cumsum(dim=1)


class _CumulativeWithoutCache(_CumulativeIgnoringCache):
    def forward(self, hidden_states):
        return self.proj(hidden_states).cumsum(dim=1)


def test_check_refuses_a_block_ignoring_the_state():
    why = handoff_check(_CumulativeIgnoringCache(), (_stream(),), {}, 0)
    assert "differs from the whole sequence's" in why, why


def test_check_refuses_a_block_without_a_cache():
    assert "takes no cache" in handoff_check(_CumulativeWithoutCache(), (_stream(),), {}, 0)



@pytest.mark.parametrize("world, checkpointed", [(2, ""), (3, ""), (3, "block"), (2, "layer")])
def test_ranks_handing_on_equal_the_whole_sequence(world, checkpointed):
    """``checkpointed``: the block under activation checkpointing (non-reentrant, as the
    trainer's), its forward run again in backward replaying what it received: the block
    alone (recomputed after its output's backward), or with code after it, as a decoder
    layer's (recomputed before it)."""
    stream = _stream()
    reference = _gated_delta_net()
    weights = torch.linspace(-1, 1, stream.numel()).reshape(stream.shape)
    whole = torch.tanh(reference(stream)) if checkpointed == "layer" else reference(stream)
    (whole * weights).sum().backward()
    tokens = TOKENS // world
    blocks = [_gated_delta_net() for _ in range(world)]  # built here: the threads share one random state

    def body(rank):
        block = blocks[rank]
        install_state_handoff(block, dist.group.WORLD, stream_index=0, where="linear_attn")
        piece = stream[:, rank * tokens:(rank + 1) * tokens]
        if checkpointed == "layer":
            out = checkpoint(lambda x: torch.tanh(block(x)), piece, use_reentrant=False)
        else:
            out = checkpoint(block, piece, use_reentrant=False) if checkpointed else block(piece)
        (out * weights[:, rank * tokens:(rank + 1) * tokens]).sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in block.named_parameters()}

    results = _run_ranks(world, body)
    torch.testing.assert_close(torch.cat([out for out, _ in results], dim=1), whole.detach(), rtol=1e-5, atol=1e-6)
    for name, param in reference.named_parameters():
        summed = sum(grads[name] for _, grads in results)
        scale = 1 + param.grad.abs().max()  # fp32 sums in another order: rounding of the largest entry
        assert torch.allclose(summed, param.grad, rtol=1e-4, atol=1e-6 * scale), (name, (summed - param.grad).abs().max(), param.grad.abs().max())


def test_a_failed_rank_wakes_the_one_waiting_for_its_state():
    """A rank failing before it hands its state on: the next rank's receive raises (the
    run fails with the first rank's error) instead of waiting out the timeout."""
    blocks = [_gated_delta_net() for _ in range(2)]

    def body(rank):
        block = blocks[rank]
        install_state_handoff(block, dist.group.WORLD, stream_index=0, where="linear_attn")
        if rank == 0:
            raise ValueError("rank 0 broke first")
        return block(_stream()[:, :TOKENS // 2])

    with pytest.raises(ValueError, match="rank 0 broke first"):
        _run_ranks(2, body)
