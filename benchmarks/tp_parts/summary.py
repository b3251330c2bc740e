"""The tensor-parallel benchmark's A/B summary: per collective backend, TP times against one GPU."""

from __future__ import annotations


def ab_summary(res: dict, batch: int) -> dict:
    """Per collective backend of the TP run (the default one chosen at load, then each reloaded one): decode
    b1 (read each step / fed), decode b`batch` and prefill 2048 in ms, with the speed-up over one GPU."""
    tp = res["tp"]
    keys = {"b1": ("decode_ms_graphs", "decode_ms_{}", "single_decode_ms"),
            "b1_fed": ("decode_fed_ms", "decode_fed_ms_{}", "single_decode_fed_ms"),
            f"b{batch}": (f"decode_b{batch}_ms", f"decode_b{batch}_ms_{{}}", f"single_decode_b{batch}_ms"),
            "prefill2048": ("prefill2048_ms", "prefill2048_ms_{}", "single_prefill2048_ms"),
            "prefill2048_pipelined": ("prefill2048_ms_pipelined", "-", "single_prefill2048_ms"),
            "prefill2048_copy": ("prefill2048_ms_copy", "-", "single_prefill2048_ms"),
            "prefill2048_pipelined_copy": ("prefill2048_ms_pipelined_copy", "-", "single_prefill2048_ms")}
    names = [tp["comm"]] + [k[len("decode_ms_"):] for k in tp if k.startswith("decode_ms_")
                            and k not in ("decode_ms_graphs", "decode_ms_eager")]
    out: dict = {"default": tp["comm"], "load_timings_us": tp.get("comm_timings_us")}
    for name in names:
        row = {}
        for label, (own, other, single) in keys.items():
            v = tp.get(own if name == tp["comm"] else other.format(name) if other != "-" else "-")
            if v is not None and res.get(single):
                row[label] = [v, round(res[single] / v, 2)]
        out[name] = row
    return out


def speedups(res: dict, batch: int) -> None:
    """res's speedup_* figures: one GPU's times over the TP run's (decode b1 read back and fed, batched, prefill)."""
    res["speedup_decode"] = round(res["single_decode_ms"] / res["tp"]["decode_ms_graphs"], 2)
    res["speedup_prefill"] = round(res["single_prefill2048_ms"] / res["tp"]["prefill2048_ms"], 2)
    if batch and f"decode_b{batch}_ms" in res["tp"]:
        res[f"speedup_decode_b{batch}"] = round(res[f"single_decode_b{batch}_ms"] / res["tp"][f"decode_b{batch}_ms"],
                                                2)
    res["speedup_decode_fed"] = round(res["single_decode_fed_ms"] / res["tp"]["decode_fed_ms"], 2)
    if batch and f"decode_fed_b{batch}_ms" in res["tp"]:
        res[f"speedup_decode_fed_b{batch}"] = round(res[f"single_decode_fed_b{batch}_ms"]
                                                    / res["tp"][f"decode_fed_b{batch}_ms"], 2)


PREFILL_WAYS = (("plain", "prefill2048_ms"), ("pipelined", "prefill2048_ms_pipelined"),
                ("copy", "prefill2048_ms_copy"), ("pipelined_copy", "prefill2048_ms_pipelined_copy"),
                ("pipelined_copy_unfused", "prefill2048_ms_pipelined_copy_unfused"))


def prefill_summary(res: dict) -> dict:
    """The prefill 2048 A/B of the default TP run in one line: per way (one chunk with the decode backend, two
    micro-batches, the copy collective, both, both with the add and the next norm apart), ms and the speed-up
    over one GPU, ms until forward returned on the host (launch-bound where close to ms), and each way's largest
    logit difference from the plain one; with the copy all-reduce's own timings (tp_parts/collectives.py)."""
    tp, one = res.get("tp", {}), res.get("single_prefill2048_ms")
    out: dict = {"single_ms": one}
    for way, key in PREFILL_WAYS:
        v = tp.get(key)
        if v is not None:
            host = tp.get(key.replace("prefill2048_ms", "prefill2048_host_ms"))
            out[way] = {"ms": v, "speedup": round(one / v, 2) if one else None, "host_ms": host,
                        "maxdiff_vs_plain": tp.get(f"{way}_vs_plain_maxdiff", 0.0 if way == "plain" else None)}
    out["allreduce_2048x8192_us"] = {k: v for k, v in res.get("allreduce_us", {}).items() if "2048x8192" in k}
    if "overlap_us" in res:
        out["overlap_us"] = res["overlap_us"]
    return out
