"""``--lengths`` (log-normal input lengths in words), ``--budgets`` (one run per token budget) and the
padding share the bench reads from the hf backends' token counters."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from batchwire.bench.lengths import WORDS, LengthInputs, Lengths
from batchwire.bench.prom import Scrape, parse_samples, server_stats
from batchwire.bench.sut import SutSpec, plan


def test_word_counts_have_the_median_and_p99_asked_for() -> None:
    inputs = LengthInputs(Lengths(16, 256), random.Random(3), field="input", nonce="n")
    counts = []
    for _ in range(20_000):
        text, body = inputs.next()
        assert json.loads(body) == {"input": text}
        head, *words = text.split(" ")
        assert head.startswith("n") and set(words) <= set(WORDS)
        counts.append(len(words))
    ordered = sorted(counts)
    assert 14 <= statistics.median(ordered) <= 18
    assert 200 <= ordered[int(0.99 * len(ordered))] <= 320
    assert max(ordered) <= 384 and min(ordered) >= 1


@pytest.mark.parametrize("text", ["16", "0:256", "300:256", "x:1", ":"])
def test_a_bad_lengths_spec_says_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="MEDIAN:P99"):
        Lengths.parse(text)


def test_a_budget_reaches_the_batchers_and_the_gateways(tmp_path: Path) -> None:
    for mode in ("kafka", "embedded"):
        spec = SutSpec(mode=mode, policy="work-conserving", max_batch_tokens=2048)
        argvs = [role.argv for role in plan(spec, ["bw"], "nsx", tmp_path).roles]
        takers = [argv for argv in argvs if argv[1] in ("up", "batcher", "gateway")]
        assert takers and all(argv[argv.index("--max-batch-tokens") + 1] == "2048" for argv in takers), argvs
    unset = plan(SutSpec(mode="kafka", policy="classic"), ["bw"], "nsx", tmp_path).roles
    assert all("--max-batch-tokens" not in role.argv for role in unset), "None leaves the roles' default"


def test_the_padding_share_is_the_windows_padding_over_all_tokens() -> None:
    url = "http://x/metrics"
    before = 'batchwire_backend_tokens_total{model="m",kind="input"} 100\n'
    before += 'batchwire_backend_tokens_total{model="m",kind="padding"} 900\n'
    after = 'batchwire_backend_tokens_total{model="m",kind="input"} 500\n'
    after += 'batchwire_backend_tokens_total{model="m",kind="padding"} 1000\n'
    stats = server_stats(
        Scrape(at=0.0, by_endpoint={url: parse_samples(before)}),
        Scrape(at=1.0, by_endpoint={url: parse_samples(after)}),
        [url],
    )
    assert stats.get("padding_share") == pytest.approx(100 / 500)
    none = server_stats(Scrape(at=0.0, by_endpoint={url: {}}), Scrape(at=1.0, by_endpoint={url: {}}), [url])
    assert none.get("padding_share") is None, "no hf backend: no share"
