"""Plain-text tables for people: one run's rates, and two runs side by side with ratios.

Everything here reads the ``results.json`` structures, so a saved file prints exactly like a
fresh run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batchwire.bench.lone import lone_line
from batchwire.bench.results import RateReport, RunReport

Cell = Callable[[RateReport], float | None]


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if abs(value) >= 10_000:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def _lat(key: str) -> Cell:
    return lambda rate: rate["latency_ms"].get(key)


def _server(key: str) -> Cell:
    def cell(rate: RateReport) -> float | None:
        server = rate["server"]
        value = server.get(key) if server is not None else None
        return float(value) if isinstance(value, int | float) else None

    return cell


def _busy_pct(rate: RateReport) -> float | None:
    server = rate["server"]
    if server is None or server["busy_fraction"] is None:
        return None
    return 100.0 * server["busy_fraction"]


def _cpu_us(rate: RateReport) -> float | None:
    group = rate["processes"].get("batchwire")
    return group["us_per_request"] if group is not None else None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(header[i]), *(len(row[i]) for row in rows)) if rows else len(header[i]) for i in range(len(header))
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(lines)


_RUN_HEADER = (
    "rate/s",
    "sent",
    "ok",
    "errors",
    "thr/s",
    "p50",
    "p90",
    "p95",
    "p99",
    "p99.9",
    "max",
    "lag99",
    "lagmax",
    "batch",
    "busy%",
    "µs/req",
    "gen%",
)


def run_table(run: RunReport) -> str:
    """The per-rate table printed after a run (latencies in ms, CPU in µs per answered request)."""
    title = f"== {run['label']}" + (f" (policy {run['policy']})" if run["policy"] else "")
    lines = [title, _table(_RUN_HEADER, [_run_row(rate) for rate in run["rates"]])]
    for rate in run["rates"]:
        lines.extend(_rate_lines(rate))
    for key, probe in (("lone", run.get("lone")), ("warm", run.get("warm"))):
        if probe is not None:
            lines.append(f"  {lone_line(probe, key)}")
    return "\n".join(lines)


def _run_row(rate: RateReport) -> list[str]:
    lag = rate["lag_ms"]
    return [
        _fmt(rate["offered_rps"], 0),
        str(rate["scheduled"]),
        str(rate["ok"]),
        str(rate["error_total"]),
        _fmt(rate["throughput_rps"]),
        *(_fmt(_lat(key)(rate)) for key in ("p50", "p90", "p95", "p99", "p99.9", "max")),
        _fmt(lag.get("p99"), 2),
        _fmt(lag.get("max")),
        _fmt(_server("batch_size_mean")(rate), 2),
        _fmt(_busy_pct(rate), 0),
        _fmt(_cpu_us(rate), 0),
        _fmt(100.0 * rate["generator"]["cores"], 0),
    ]


def _rate_lines(rate: RateReport) -> list[str]:
    """One rate's errors, flushes, other processes' CPU, refusals, 504s, late answers and notes."""
    lines: list[str] = []
    label = f"  {rate['offered_rps']:g}/s"
    if rate["errors"]:
        lines.append(f"{label} errors: " + " ".join(f"{k}={v}" for k, v in rate["errors"].items()))
    server = rate["server"]
    if server is not None and server["flushes"]:
        lines.append(f"{label} flushes: " + " ".join(f"{k}={v:g}" for k, v in sorted(server["flushes"].items())))
    padding = server.get("padding_share") if server is not None else None
    if padding is not None:
        lines.append(f"{label} padding: {100 * padding:.1f}% of the tokens the backends ran")
    if server is not None and server.get("redelivered"):
        lines.append(f"{label} redelivered batches: {server['redelivered']:g} (each run with care, in halves)")
    others = {k: g for k, g in rate["processes"].items() if k != "batchwire"}
    if others:
        lines.append(
            f"{label} cpu: "
            + " ".join(f"{k}={g['cores']:.2f} cores ({_fmt(g['us_per_request'], 0)} µs/req)" for k, g in others.items())
        )
    refused = rate["refused_ms"]
    if refused.get("count"):
        lines.append(f"{label} {refused_line(rate)}")
    after = rate["after_504"]
    if after["answered"]:
        lines.append(f"{label} {after_504_line(rate)}")
    if rate["drained_answers"]:
        lines.append(
            f"{label} {rate['drained_answers']} answers came after the window "
            f"(last {1000 * rate['drain_s']:.0f} ms after it)"
        )
    lines.extend(f"{label} NOTE: {note}" for note in rate["notes"])
    return lines


def refused_line(rate: RateReport) -> str:
    """Refusals (503, 429): latency from the schedule, then from the send (the generator's lag left out)."""
    refused, sent = rate["refused_ms"], rate["refused_from_send_ms"]
    return (
        f"refused (503/429) {refused.get('count', 0):.0f}: p50 {_fmt(refused.get('p50'), 2)}, "
        f"p99 {_fmt(refused.get('p99'), 2)}, max {_fmt(refused.get('max'), 2)} ms from the schedule; "
        f"p99 {_fmt(sent.get('p99'), 2)} ms from the send (generator lag p99 {_fmt(rate['lag_ms'].get('p99'), 2)} ms)"
    )


def after_504_line(rate: RateReport) -> str:
    """504 answers and how many of their tasks the service computed anyway, read back after the run."""
    after = rate["after_504"]
    share = after["share_of_computed"]
    statuses = " ".join(f"{k}={v}" for k, v in after["statuses"].items()) or "none read"
    return (
        f"504 {after['answered']}: computed after the 504 {after['computed']}"
        + (f" ({100 * share:.2f}% of {rate['ok'] + after['computed']} computed)" if share is not None else "")
        + f"; read back: {statuses}"
    )


COMPARED: tuple[tuple[str, Cell], ...] = (
    ("thr/s", lambda rate: rate["throughput_rps"]),
    ("p50", _lat("p50")),
    ("p99", _lat("p99")),
    ("p99.9", _lat("p99.9")),
    ("batch", _server("batch_size_mean")),
    ("busy%", _busy_pct),
    ("µs/req", _cpu_us),
    ("errors", lambda rate: float(rate["error_total"])),
)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}x"


def compare_table(a: RunReport, b: RunReport, name_a: str = "A", name_b: str = "B") -> str:
    """Two runs per offered rate: each metric as A, B and B/A (rates present in one run only show -)."""
    rates_a = {rate["offered_rps"]: rate for rate in a["rates"]}
    rates_b = {rate["offered_rps"]: rate for rate in b["rates"]}
    lines = [
        f"{name_a} = {a['label']}" + (f" (policy {a['policy']})" if a["policy"] else ""),
        f"{name_b} = {b['label']}" + (f" (policy {b['policy']})" if b["policy"] else ""),
    ]
    halves = (COMPARED[:4], COMPARED[4:])
    for half in halves:
        header = ["rate/s"]
        for metric, _ in half:
            header += [f"{metric} {name_a}", f"{metric} {name_b}", f"{name_b}/{name_a}"]
        rows = []
        for offered in sorted(set(rates_a) | set(rates_b)):
            row = [_fmt(offered, 0)]
            for _, cell in half:
                va = cell(rates_a[offered]) if offered in rates_a else None
                vb = cell(rates_b[offered]) if offered in rates_b else None
                row += [_fmt(va), _fmt(vb), _ratio(va, vb)]
            rows.append(row)
        lines += ["", _table(header, rows)]
    lone_a, lone_b = a.get("lone"), b.get("lone")
    if lone_a is not None and lone_b is not None:
        lines.append("")
        for key in ("p50", "p99"):
            va, vb = lone_a["latency_ms"].get(key), lone_b["latency_ms"].get(key)
            lines.append(f"lone {key}: {name_a} {_fmt(va)}, {name_b} {_fmt(vb)} ms, {name_b}/{name_a} {_ratio(va, vb)}")
    return "\n".join(lines)
