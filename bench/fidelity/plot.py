"""The fidelity benchmark's trade-off curves as one figure (matplotlib's object API: no pyplot, no GUI).

matplotlib is the optional `plot` extra (`pip install 'npumoed[plot]'`); only `bench fidelity --plot` needs it.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from npumoe.engine.vocabulary import PRUNE, SPILL

from .capacity import OVERFLOWS


def fidelity_figure(rows: Sequence[dict]) -> Figure:
    """Three panels from `run_fidelity_bench` rows: what the capacity scale does to the assignments, to
    accuracy, and accuracy against prefill time (the trade-off), with the exact model's time marked."""
    exact = next(row for row in rows if row["impl"] == "exact")
    by_policy = {overflow: sorted((row for row in rows if row.get("overflow") == overflow),
                                  key=lambda row: row["capacity_scale"]) for overflow in OVERFLOWS}
    prune, spill = by_policy[PRUNE], by_policy[SPILL]
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    work, accuracy, tradeoff = figure.subplots(1, 3)

    scales = [row["capacity_scale"] for row in prune]
    work.plot(scales, [row["dropped_fraction"] for row in prune], "o-", label="dropped (prune)")
    work.plot([row["capacity_scale"] for row in spill], [row["spilled_fraction"] for row in spill], "s--",
              label="spilled to CPU (spill)")
    work.plot(scales, [row["padding_fraction"] for row in prune], "^:", label="padding slots")
    work.set(xlabel="capacity scale (× calibrated p95 load)", ylabel="fraction", title="Assignments")
    work.legend()

    accuracy.plot(scales, [row["top1_agreement"] for row in prune], "o-", color="C0")
    accuracy.set(xlabel="capacity scale (× calibrated p95 load)", ylabel="top-1 agreement with exact",
                 title="Accuracy under prune")
    kl_axis = accuracy.twinx()
    kl_axis.plot(scales, [row["mean_kl"] for row in prune], "s--", color="C3")
    kl_axis.set_ylabel("mean KL(exact ‖ engine)", color="C3")

    for overflow, marker in zip(OVERFLOWS, "os", strict=True):
        points = by_policy[overflow]
        ms_per_token = [1e3 / row["tokens_per_s"] for row in points]
        tradeoff.plot(ms_per_token, [row["mean_kl"] for row in points], marker, label=overflow)
        for x, row in zip(ms_per_token, points, strict=True):
            tradeoff.annotate(f"×{row['capacity_scale']:g}", (x, row["mean_kl"]), textcoords="offset points",
                              xytext=(4, 4), fontsize=8)
    tradeoff.axvline(1e3 / exact["tokens_per_s"], color="grey", linestyle=":", label="exact model")
    tradeoff.set(xlabel="prefill ms per token", ylabel="mean KL(exact ‖ engine)", title="Accuracy vs latency")
    tradeoff.legend()
    return figure
