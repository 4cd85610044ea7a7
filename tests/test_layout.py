import pytest

from weightpull import InvalidArgumentError, Layout, TensorSpec, plan_layout


def specs(*sizes, dtype="uint8"):
    return [TensorSpec(f"w{i}", dtype, (n,)) for i, n in enumerate(sizes)]


def test_offsets_are_aligned_and_tensors_do_not_overlap():
    layout = plan_layout(specs(3, 100, 1, 700, 17), bucket_bytes=1024, align=64)
    ends = 0
    for p in layout.placements:
        assert p.offset % 64 == 0 and p.offset >= ends
        ends = p.end
    assert layout.total_bytes % 64 == 0 and layout.total_bytes >= ends


def test_buckets_hold_at_most_bucket_bytes_and_cover_every_tensor():
    layout = plan_layout(specs(*[300] * 10), bucket_bytes=1024, align=4)
    assert [b.names for b in layout.buckets] == [("w0", "w1", "w2"), ("w3", "w4", "w5"), ("w6", "w7", "w8"), ("w9",)]
    for b in layout.buckets:
        assert b.nbytes <= 1024
        for name in b.names:
            p = layout[name]
            assert p.bucket == b.index and b.offset <= p.offset and p.end <= b.offset + b.nbytes


def test_tensor_larger_than_a_bucket_gets_a_bucket_of_its_own():
    layout = plan_layout(specs(100, 5000, 100, 100), bucket_bytes=1024, align=256)
    assert [b.names for b in layout.buckets] == [("w0",), ("w1",), ("w2", "w3")]
    assert layout.buckets[1].nbytes == 5000


def test_dtype_sizes_count():
    layout = plan_layout([TensorSpec("a", "bfloat16", (3, 5)), TensorSpec("b", "float32", (7,))], align=8)
    assert layout["a"].spec.nbytes == 30 and layout["b"].offset == 32 and layout["b"].spec.nbytes == 28


def test_signature_changes_when_the_model_changes_shape():
    base = plan_layout(specs(10, 20)).signature
    assert plan_layout(specs(10, 20)).signature == base
    assert plan_layout(specs(10, 21)).signature != base
    assert plan_layout(specs(10, 20, dtype="int8")).signature != base
    assert plan_layout(specs(10, 20), bucket_bytes=4096).signature != base


def test_round_trip_through_a_dict_and_signature_check():
    layout = plan_layout(specs(10, 20, 4000), bucket_bytes=1024)
    again = Layout.from_dict(layout.to_dict())
    assert again == layout
    tampered = layout.to_dict() | {"signature": "0" * 32}
    with pytest.raises(InvalidArgumentError, match="signature"):
        Layout.from_dict(tampered)
    with pytest.raises(InvalidArgumentError, match="malformed"):
        Layout.from_dict({"tensors": "nope"})


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: plan_layout([]), "at least one"),
        (lambda: plan_layout(specs(1, 1) + [TensorSpec("w0", "uint8", (1,))]), "twice"),
        (lambda: plan_layout(specs(1), bucket_bytes=0), "bucket_bytes"),
        (lambda: plan_layout(specs(1), align=3), "power of two"),
        (lambda: TensorSpec("x", "complex32", (1,)), "unsupported dtype"),
        (lambda: TensorSpec("", "uint8", (1,)), "name"),
        (lambda: TensorSpec("x", "uint8", (-1,)), "non-negative"),
    ],
)
def test_bad_input_is_named(make, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make()
