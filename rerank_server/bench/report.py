"""The report: `bench.md` from the results, and the two plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .telemetry import telemetry_markdown


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Machine: {report['machine']}. Command: `{report['command']}`.", ""]
    if "overhead" in report:
        lines += [
            "#### Overhead (instant fake backend)",
            "",
            "Latency through rerank-server, the same backend calls replayed "
            "directly (the backend's own time), the difference (what rerank-server "
            "adds), and the same request to a bare gRPC server (the hop alone). "
            "Server CPU per pair with the server idle between requests (one client "
            "in turn), with the same requests back to back (busy: what bounds "
            "capacity), and the bare gRPC server's for the same requests (idle "
            "between them: the hop's own share).",
            "",
            "| backend | candidates | p50 ms | p99 ms | direct p50 ms | added p50 ms "
            "| bare gRPC p50 ms | server CPU µs / pair | busy | bare gRPC |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for kind, sizes in report["overhead"].items():
            for size, r in sizes.items():
                lines.append(
                    f"| {kind} | {size} | {r['p50_ms']} | {r['p99_ms']} | "
                    f"{r['direct_p50_ms']} | {r['added_p50_ms']} | "
                    f"{r['bare_grpc_p50_ms']} | {r['cpu_us_per_pair']} | "
                    f"{r['busy_cpu_us_per_pair']} | "
                    f"{r['bare_grpc_cpu_us_per_pair']} |"
                )
        lines.append("")
    if "telemetry" in report:
        for by_kind in report["telemetry"].values():
            lines += telemetry_markdown(by_kind)
    if "model" in report:
        m = report["model"]
        under_test = report.get("backend_under_test", "llama-server, stand-in model")
        lines += [
            f"#### Against the model ({under_test})",
            "",
            f"`{m['backend']}`, {m['passages']} passages, {m['slots']} slots, "
            f"median of {m['rounds']} rounds: direct {m['direct_ms']} ms "
            f"({m['direct_pairs_per_s']} pairs/s), through rerank-server "
            f"{m['through_ms']} ms ({m['through_pairs_per_s']} pairs/s), ratio "
            f"{m['through_over_direct']}; p50/p95 direct {m['direct_p50_ms']}/"
            f"{m['direct_p95_ms']} ms, through {m['through_p50_ms']}/"
            f"{m['through_p95_ms']} ms.",
            "",
        ]
        lines += [_eager_line(m.get("eager", {})), ""]
        rows = [m, *m.get("load", {}).values()]
        lost = [
            sum(r[key] for r in rows) for key in ("direct_failed_pairs", "through_unscored_pairs")
        ]
        if any(lost):
            lines += [
                f"**Not comparable:** the backend did not answer {lost[0]} pairs "
                f"called directly, and {lost[1]} pairs through rerank-server were not "
                f"scored (a degraded answer is fast and in retrieval order), over the "
                f"measured rounds and the load together.",
                "",
            ]
        if m.get("load"):
            lines += [
                "| clients | direct pairs/s | through pairs/s | through / direct "
                "| pairs failed directly | pairs unscored through |",
                "|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {n} | {r['direct_pairs_per_s']} | {r['through_pairs_per_s']} | "
                f"{r['through_over_direct']} | {r['direct_failed_pairs']} | "
                f"{r['through_unscored_pairs']} |"
                for n, r in m["load"].items()
            ]
            lines.append("")
    if "throughput" in report:
        lines += [
            "#### Throughput (instant fake backend, 20 candidates)",
            "",
            "| workers | clients | requests/s | pairs/s | p50 ms | p99 ms | errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for workers, by_clients in report["throughput"].items():
            for clients, r in by_clients.items():
                lines.append(
                    f"| {workers} | {clients} | {r['requests_per_s']} | "
                    f"{r['pairs_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
                    f"{r['errors']} |"
                )
        lines.append("")
    if "streaming" in report:
        lines += [
            "#### Streaming",
            "",
            "Median time to the first `RerankStream` result and to the whole `Rerank` "
            "answer; `default` is the server's default blend (`profile`).",
            "",
            "| backend, candidates | blend (as answered) | first result ms | "
            "whole answer ms | first / whole |",
            "|---|---|---|---|---|",
        ]
        for setting, blends in report["streaming"].items():
            for blend, r in blends.items():
                lines.append(
                    f"| {setting} | {blend}: {r['blended_by']} | "
                    f"{r['first_result_ms']} | {r['whole_answer_ms']} | "
                    f"{r['first_over_whole']} |"
                )
        lines.append("")
    if "settings" in report:
        lines += [
            "#### llama-server settings (stand-in model, through rerank-server)",
            "",
            "| llama-server | chat ms | chat pairs/s | completion ms | completion pairs/s |",
            "|---|---|---|---|---|",
        ]
        for cell, r in report["settings"].items():
            lines.append(
                f"| `{cell}` | {r['chat']['ms']} | {r['chat']['pairs_per_s']} | "
                f"{r['completion']['ms']} | {r['completion']['pairs_per_s']} |"
            )
        lines.append("")
    if "completion_options" in report:
        lines += [
            "#### `/completion` options (llama-server called directly)",
            "",
            "| options | ms | pairs/s | yes or no in the top n_probs |",
            "|---|---|---|---|",
        ]
        for option, r in report["completion_options"].items():
            lines.append(f"| {option} | {r['ms']} | {r['pairs_per_s']} | {r['yes_or_no_in_top']} |")
        lines.append("")
    if "backends" in report:
        b = report["backends"]
        lines += [
            "#### chat vs completion",
            "",
            f"{b['passages']} passages, {b['slots']} "
            f"slots, median of {b['rounds']}: chat {b['chat_ms']} ms, completion "
            f"{b['completion_ms']} ms (ratio {b['completion_over_chat']}).",
            "",
        ]
    return "\n".join(lines)


def _eager_line(eager: dict[str, Any]) -> str:
    if "pairs_per_s" not in eager:
        return f"Physical limit not measured: {eager.get('skipped') or 'not asked'}."
    return (
        f"Physical limit, the same weights and tokens in eager PyTorch ({eager['device']}, "
        f"{eager['dtype']}, batches of {eager['batch']}, {eager['tokens']} tokens): "
        f"{eager['ms']} ms ({eager['pairs_per_s']} pairs/s); through rerank-server is "
        f"{eager['through_over_eager']} of it."
    )


def plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "overhead" in report:
        fig, ax = plt.subplots(figsize=(8, 4))
        kinds = list(report["overhead"])
        ax.boxplot(
            [report["overhead"][k]["40"]["latencies_ms"] for k in kinds],
            tick_labels=kinds,
            showfliers=True,
        )
        ax.set_ylabel("latency per request (ms)")
        ax.set_title("rerank-server overhead: 40 candidates, instant backend")
        fig.tight_layout()
        fig.savefig(out / "bench-latency.png", dpi=100)
        written.append("bench-latency.png")
    if "throughput" in report:
        fig, ax = plt.subplots(figsize=(6, 4))
        for workers, by_clients in report["throughput"].items():
            clients = [int(c) for c in by_clients]
            ax.plot(
                clients,
                [by_clients[str(c)]["requests_per_s"] for c in clients],
                marker="o",
                label=f"{workers} worker{'s' if workers != '1' else ''}",
            )
        ax.legend()
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("requests/s (20 candidates each)")
        ax.set_title("throughput against an instant backend")
        fig.tight_layout()
        fig.savefig(out / "bench-throughput.png", dpi=100)
        written.append("bench-throughput.png")
    plt.close("all")
    return written
