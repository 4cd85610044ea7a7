"""A rollout rank's slice of a Hugging Face checkpoint (`slicing.rollout_slice`), from
the tensors' names, and the checkpoint-shaped tensors it hands its engine
(`slicing.checkpoint_tensors`): each rank reads its share of what vLLM splits, the whole
of what it replicates or what the rule does not know, and the ranks together read every
element; what it hands over holds the weights exactly in its boxes."""

import torch
from transformers import LlamaForCausalLM

from weightpull.integrations.torch_tensors import as_tensors
from weightpull.integrations.verl.slicing import checkpoint_tensors, rollout_slice
from weightpull.layout import TensorSpec, plan_layout
from weightpull.transports import create_transport

from .workers import TINY


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: t.to(torch.bfloat16) for n, t in LlamaForCausalLM(TINY).state_dict().items()}


def specs(weights):
    return [TensorSpec(n, "bfloat16", tuple(t.shape)) for n, t in weights.items()]


def boxes(rank_slice):
    return {p.name: [pc.box for pc in p.pieces] for p in rank_slice.params}


def test_each_rank_reads_its_share_of_what_vllm_splits_and_the_whole_of_the_rest():
    weights = state()
    got = [boxes(rollout_slice(specs(weights), r, 2)) for r in range(2)]
    layer = "model.layers.0."
    assert [g[layer + "self_attn.q_proj.weight"] for g in got] == [[((0, 32), (0, 64))], [((32, 64), (0, 64))]]
    assert [g[layer + "mlp.up_proj.weight"] for g in got] == [[((0, 64), (0, 64))], [((64, 128), (0, 64))]]
    assert [g[layer + "self_attn.o_proj.weight"] for g in got] == [[((0, 64), (0, 32))], [((0, 64), (32, 64))]]
    assert [g[layer + "mlp.down_proj.weight"] for g in got] == [[((0, 64), (0, 64))], [((0, 64), (64, 128))]]
    assert [g["model.embed_tokens.weight"] for g in got] == [[((0, 256), (0, 64))], [((256, 512), (0, 64))]]
    whole = [((0, 32), (0, 64))]  # KV heads: which a rank holds needs the model's config
    assert [g[layer + "self_attn.k_proj.weight"] for g in got] == [whole, whole]
    assert [g["model.norm.weight"] for g in got] == [[((0, 64),)], [((0, 64),)]]
    # Together the ranks read every element.
    for name, t in weights.items():
        covered = torch.zeros(t.shape, dtype=torch.bool)
        for g in got:
            for box in g[name]:
                covered[tuple(slice(a, b) for a, b in box)] = True
        assert covered.all(), name


def test_what_does_not_split_evenly_or_is_unknown_is_read_whole():
    odd = [
        TensorSpec("model.layers.0.self_attn.q_proj.weight", "bfloat16", (3, 4)),
        TensorSpec("model.layers.0.self_attn.W_pack.weight", "bfloat16", (6, 4)),
        TensorSpec("lm_head.weight", "bfloat16", (100, 4)),  # padded to 128: 64 rows each
    ]
    got = boxes(rollout_slice(odd, 1, 2))
    assert got[odd[0].name] == [((0, 3), (0, 4))] and got[odd[1].name] == [((0, 6), (0, 4))]
    assert got["lm_head.weight"] == [((64, 100), (0, 4))]  # rows 64..128 of the padded vocab, 100.. unwritten
    assert boxes(rollout_slice(odd, 1, 3))["lm_head.weight"] == [((0, 100), (0, 4))]  # 128 over 3: whole


def test_the_tensors_handed_over_hold_the_weights_in_every_box_and_reuse_the_mirror_for_whole_ones():
    weights = state()
    full = plan_layout(specs(weights))
    rank_slice = rollout_slice(specs(weights), 1, 2)
    mirror_layout = rank_slice.layout()
    transport = create_transport("fake")
    region = transport.allocate(mirror_layout.total_bytes, "cpu")
    mirror = as_tensors(mirror_layout, region)
    for param in rank_slice.params:  # what a pull would have read
        for piece in param.pieces:
            src = weights[piece.source][tuple(slice(a, b) for a, b in piece.box)]
            mirror[param.name][tuple(slice(a, a + e) for a, e in zip(piece.at, piece.extent, strict=True))] = src
    handed = dict(checkpoint_tensors(full, rank_slice, mirror))
    assert list(handed) == list(weights)
    for param in rank_slice.params:
        got, want = handed[param.name], weights[param.name]
        assert got.shape == want.shape and got.dtype == want.dtype
        for piece in param.pieces:
            index = tuple(slice(a, b) for a, b in piece.box)
            assert torch.equal(got[index], want[index]), param.name
    norm = "model.norm.weight"
    assert handed[norm].data_ptr() == mirror[norm].data_ptr()  # read whole: the mirror's view itself
