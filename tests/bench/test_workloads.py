"""The skewed shared-prefix workload of S4's eviction half: its shape, seeded."""

from collections import Counter

from pagedserve.bench.workloads import make_workload


def test_skewed_prefix_mixes_zipf_system_prompts_with_one_off_prompts():
    requests = make_workload("skewed-prefix", 400, 512, 7)
    assert requests == make_workload("skewed-prefix", 400, 512, 7)
    heads = Counter(tuple(r.prompt[:256]) for r in requests)
    shared = [count for count in heads.values() if count > 1]
    assert len(shared) == 6  # the system prompts; every other head is a one-off prompt's
    assert sorted(shared, reverse=True)[0] > 3 * min(shared)  # Zipf: the first is the hottest
    assert 150 < sum(shared) < 250  # about half the requests
    assert all(r.output_len == 8 and 128 <= len(r.prompt) <= 512 for r in requests)
