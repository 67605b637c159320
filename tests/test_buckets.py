"""The bucket-assignment policy, without processes."""

import zlib

import pytest
import torch

from tandem.comm.agreement.agree import checksum
from tandem.parallel.data_parallel.buckets import ParamInfo, assign_buckets, describe_layout, explain_layout

F32, F16 = torch.float32, torch.float16
KB = 1024


def p(name, numel, dtype=F32, device="cpu"):
    return ParamInfo(name, (numel,), dtype, device)


def members(buckets):
    return [list(b.params) for b in buckets]


def test_first_bucket_is_small_then_cap():
    # 1 KiB params (256 floats): first cap 1 KiB -> 1 param; later cap 3 KiB -> 3 params each.
    params = [p(f"w{i}", 256) for i in range(8)]
    buckets = assign_buckets(params, cap_bytes=3 * KB, first_cap_bytes=1 * KB)
    assert members(buckets) == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [b.index for b in buckets] == [0, 1, 2, 3]


def test_first_cap_none_means_cap():
    params = [p(f"w{i}", 256) for i in range(4)]
    assert members(assign_buckets(params, 2 * KB, None)) == [[0, 1], [2, 3]]


def test_bigger_than_cap_gets_its_own_bucket():
    params = [p("small", 10), p("huge", 10_000), p("tail", 10)]
    buckets = assign_buckets(params, cap_bytes=1 * KB, first_cap_bytes=1 * KB)
    assert members(buckets) == [[0, 1], [2]]  # closed right after the huge one
    assert buckets[0].numel >= 10_010


def test_never_mixes_dtypes_and_keeps_order():
    params = [p("a", 100, F32), p("b", 100, F16), p("c", 100, F32), p("d", 100, F16), p("e", 100, F32)]
    buckets = assign_buckets(params, cap_bytes=1 * KB, first_cap_bytes=1 * KB)
    for b in buckets:
        assert {params[i].dtype for i in b.params} == {b.dtype}
        assert list(b.params) == sorted(b.params)
    assert sorted(i for b in buckets for i in b.params) == list(range(5))


def test_never_mixes_devices():
    params = [p("a", 10, device="cuda:0"), p("b", 10, device="cuda:1"), p("c", 10, device="cuda:0")]
    buckets = assign_buckets(params, cap_bytes=1 * KB, first_cap_bytes=1 * KB)
    assert sorted(members(buckets)) == [[0, 2], [1]]
    assert all(len({params[i].device for i in b.params}) == 1 for b in buckets)


def test_buckets_ordered_by_completion():
    # The f16 bucket {1} completes (its last param is ready) before the f32 bucket {0, 2}.
    params = [p("a", 10, F32), p("b", 10, F16), p("c", 10, F32)]
    buckets = assign_buckets(params, cap_bytes=1 * KB, first_cap_bytes=1 * KB)
    assert members(buckets) == [[1], [0, 2]]
    assert [b.index for b in buckets] == [0, 1]


def test_offsets_aligned_disjoint_and_inside():
    params = [p("a", 3, F32), p("b", 5, F16), p("c", 7, F32), p("d", 1, F16), p("e", 33, F32)]
    for bucket in assign_buckets(params, cap_bytes=10 * KB, first_cap_bytes=10 * KB, align_bytes=64):
        itemsize = torch.empty((), dtype=bucket.dtype).element_size()
        end = 0
        for i, offset, n in zip(bucket.params, bucket.offsets, bucket.numels, strict=True):
            assert (offset * itemsize) % 64 == 0
            assert offset >= end and n == params[i].numel
            end = offset + n
        assert bucket.numel == end
        assert bucket.nbytes == end * itemsize


def test_every_parameter_exactly_once_randomized():
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        count = int(torch.randint(1, 30, (1,), generator=generator))
        sizes = torch.randint(1, 5000, (count,), generator=generator).tolist()
        kinds = torch.randint(0, 2, (count,), generator=generator).tolist()
        params = [p(f"p{i}", n, F16 if k else F32) for i, (n, k) in enumerate(zip(sizes, kinds, strict=True))]
        cap = int(torch.randint(100, 20_000, (1,), generator=generator))
        last_cap = None if trial % 2 else max(1, cap // 4)
        buckets = assign_buckets(params, cap_bytes=cap, first_cap_bytes=max(1, cap // 4),
                                 last_cap_bytes=last_cap)
        assert sorted(i for b in buckets for i in b.params) == list(range(count)), trial
        last = [b.params[-1] for b in buckets]
        assert last == sorted(last), trial
        for b in buckets:
            assert len({(params[i].dtype, params[i].device) for i in b.params}) == 1, trial
            if last_cap is None:  # at most one parameter beyond the cap
                assert sum(params[i].nbytes for i in b.params[:-1]) < cap, trial


def test_invalid_caps():
    with pytest.raises(ValueError, match="cap_bytes"):
        assign_buckets([p("a", 1)], cap_bytes=0)
    with pytest.raises(ValueError, match="first_cap_bytes"):
        assign_buckets([p("a", 1)], cap_bytes=10, first_cap_bytes=-1)
    assert assign_buckets([], cap_bytes=10) == []


def test_layout_description_ignores_device_index():
    params0 = [p("w", 4, device="cuda:0")]
    params1 = [p("w", 4, device="cuda:1")]
    lines0 = describe_layout(params0, assign_buckets(params0))
    lines1 = describe_layout(params1, assign_buckets(params1))
    assert lines0 == lines1
    changed = [ParamInfo("w", (5,), F32, "cuda:0")]
    assert checksum(describe_layout(changed, assign_buckets(changed))) != checksum(lines0)


def test_param_info_of_tensor():
    info = ParamInfo.of("w", torch.zeros(3, 4, dtype=torch.float64))
    assert (info.shape, info.numel, info.nbytes, info.device) == ((3, 4), 12, 96, "cpu")


def test_small_last_bucket():
    # 1 KiB params: first cap 1 KiB, cap 3 KiB, last cap 2 KiB -> the last two params alone.
    params = [p(f"w{i}", 256) for i in range(8)]
    buckets = assign_buckets(params, cap_bytes=3 * KB, first_cap_bytes=1 * KB, last_cap_bytes=2 * KB)
    assert members(buckets) == [[0], [1, 2, 3], [4, 5], [6, 7]]


def test_small_last_bucket_absorbs_a_smaller_leftover():
    # Main split: [0 (big)], then [1] alone (small) -> merged into the tail [1, 2].
    params = [p("big", 1024), p("small", 16), p("last", 256)]
    buckets = assign_buckets(params, cap_bytes=3 * KB, first_cap_bytes=1 * KB, last_cap_bytes=1 * KB)
    assert members(buckets) == [[0], [1, 2]]


def test_small_last_bucket_per_kind_and_tiny_models():
    params = [p("a", 100, F32), p("b", 100, F16), p("c", 100, F32), p("d", 100, F16)]
    buckets = assign_buckets(params, cap_bytes=10 * KB, first_cap_bytes=1 * KB, last_cap_bytes=1 * KB)
    assert sorted(members(buckets)) == [[0, 2], [1, 3]]  # everything fits: one bucket per kind
    with pytest.raises(ValueError, match="last_cap_bytes"):
        assign_buckets(params, cap_bytes=10, last_cap_bytes=0)


def test_layout_mismatch_names_each_rank_against_the_first():
    same = [p("w", 4)]
    other = [ParamInfo("w", (5,), F32, "cpu")]
    layouts = [describe_layout(ps, assign_buckets(ps)) for ps in (same, same, other)]
    text = explain_layout("DistributedOptimizer", [0, 1, 2], layouts)
    assert text.startswith("DistributedOptimizer: the ranks' parameters differ")
    assert "rank 1" not in text  # rank 1 agrees with rank 0
    assert "rank 0: param 0 w (4,)" in text and "rank 2: param 0 w (5,)" in text


# -- exact boundaries (found by mutation testing: scripts/mutation.sh) ------------------------

U8 = torch.uint8  # one byte per element: sizes in bytes are exact


def test_a_bucket_closes_when_it_reaches_its_cap_not_a_byte_before():
    # 1023 + 1 bytes reach the 1024-byte cap exactly: closed there, at >=.
    params = [p("a", 1023, U8), p("b", 1, U8), p("c", 1, U8)]
    assert members(assign_buckets(params, cap_bytes=1024, first_cap_bytes=1024)) == [[0, 1], [2]]
    assert members(assign_buckets(params, cap_bytes=1025, first_cap_bytes=1025)) == [[0, 1, 2]]


def test_offsets_are_the_next_aligned_position_exactly():
    params = [p("a", 1, F32), p("b", 16, F32), p("c", 17, F32), p("d", 3, F32)]
    bucket, = assign_buckets(params, cap_bytes=10 * KB, first_cap_bytes=10 * KB, align_bytes=64)
    # 64 bytes = 16 floats: each parameter starts at the next multiple of 16, none later.
    assert bucket.offsets == (0, 16, 32, 64) and bucket.numel == 67
    assert all(type(offset) is int for offset in bucket.offsets)
    packed, = assign_buckets(params, cap_bytes=10 * KB, first_cap_bytes=10 * KB, align_bytes=1)
    assert packed.offsets == (0, 1, 17, 34) and packed.numel == 37  # no padding at all
    # An alignment that is not a multiple of the item size rounds down to whole items.
    odd, = assign_buckets(params, cap_bytes=10 * KB, first_cap_bytes=10 * KB, align_bytes=6)
    assert odd.offsets == (0, 1, 17, 34) and all(type(o) is int for o in odd.offsets)


def test_small_last_bucket_reaches_its_cap_exactly():
    # From the end: 1024 bytes, then 1023 (2047 < 2048: go on), then 10 (2057): the tail
    # holds the last three; a tail that reached 2048 after two would be one parameter short.
    params = [p("w", 4096, U8), p("x", 10, U8), p("y", 1023, U8), p("z", 1024, U8)]
    buckets = assign_buckets(params, cap_bytes=8 * KB, first_cap_bytes=8 * KB, last_cap_bytes=2048)
    assert members(buckets) == [[0], [1, 2, 3]]


def test_small_last_bucket_of_each_kind_when_the_kinds_interleave():
    # The float32 tail is full after "c"; the scan goes on to find the float16 tail ("a").
    params = [p("z", 4096, F16), p("a", 512, F16), p("b", 1024, F32), p("c", 1024, F32)]
    buckets = assign_buckets(params, cap_bytes=64 * KB, first_cap_bytes=64 * KB,
                             last_cap_bytes=1024)
    assert members(buckets) == [[0], [1], [2], [3]]
    assert [b.dtype for b in buckets] == [F16, F16, F32, F32]


def test_bucket_keeps_the_device_and_param_info_its_name_and_device():
    params = [p("w", 4, device="cuda:1")]
    assert assign_buckets(params)[0].device == "cuda:1"
    info = ParamInfo.of("w", torch.zeros(3, device="meta"))
    assert (info.name, info.device) == ("w", "meta")


def test_every_limit_must_be_positive_and_one_is_enough():
    # One byte is a valid limit: a 4-byte parameter alone fills a 1-byte first or last bucket.
    for keyword, expected in [("cap_bytes", [[0, 1]]), ("first_cap_bytes", [[0], [1]]),
                              ("last_cap_bytes", [[0], [1]]), ("align_bytes", [[0, 1]])]:
        with pytest.raises(ValueError, match=f"{keyword} must be positive.*, got 0"):
            assign_buckets([p("a", 1)], **{keyword: 0})
        assert members(assign_buckets([p("a", 1), p("b", 1)], **{keyword: 1})) == expected, keyword


def test_layout_lines_and_code_are_exact():
    params = [p("w", 4, F16, device="cuda:1"), p("b", 2)]
    buckets = assign_buckets(params)
    lines = describe_layout(params, buckets)
    assert lines == [
        "param 0 w (4,) float16 cuda",
        "param 1 b (2,) float32 cpu",
        "bucket 0 float16 params=[0] offsets=[0] numel=4",
        "bucket 1 float32 params=[1] offsets=[0] numel=2",
    ]
    assert checksum(lines) == zlib.crc32("\n".join(lines).encode()) & 0x7FFFFFFF
    codes = {checksum(lines[:k]) for k in range(1, 5)}
    assert len(codes) == 4 and all(0 <= c < 2**31 for c in codes)
