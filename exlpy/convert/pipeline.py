"""The conversion job, stage by stage (spec §4.1): measure -> optimize -> quantize -> compile.

Every stage resumes from the job file; modules run one at a time on one device, hidden states stay on the
device when they fit (else in host memory), and the head is quantized in vocabulary slices.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.convert import caldata
from exlpy.convert.compile import check_output_dir, compile_output, stored_names, write_model_dir
from exlpy.convert.forward import States, _run, check_finite, forward_chunks, module_input
from exlpy.convert.job import Job, write_json, write_tensors, writing
from exlpy.convert.layers import OPTIONS, SourcePrefetch, is_decoder, module_bits, module_numel, shapes, slots
from exlpy.convert.measure import measure_module
from exlpy.convert.moe import measure_moe, quantize_moe
from exlpy.convert.optimize import choose, reachable, slot_error
from exlpy.convert.progress import StageProgress, peak_memory, summary_table
from exlpy.convert.qparams import QParams, bpw
from exlpy.convert.quantize import head_hessian, quantize_head, quantize_module
from exlpy.convert.sensitivity import module_sensitivity, token_error
from exlpy.convert.settings import MAX_BPW, ConvertSettings
from exlpy.engine import ExLlamaV2
from exlpy.errors import ConvertSettingsError, MeasurementFileError, UnsupportedArchitectureError
from exlpy.model.batch import contiguous_batch
from exlpy.model.linear import linear_format
from exlpy.model.mlp import MLP
from exlpy.model.module import Module
from exlpy.model.moe import MoEMLP


def convert(in_dir: str | None = None, out_dir: str | None = None, compile_dir: str | None = None,
            **kwargs: Any) -> dict[str, Any]:
    """Convert the Hugging Face model in `in_dir` to EXL2 (exlpy convert -i IN -o OUT -cf COMPILE ...).

    Keyword arguments are ConvertSettings fields: bits (4.125), head_bits (6), cal_dataset, measurement,
    output_measurement, rows (100), length (2048), measurement_rows (16), measurement_length (2048),
    shard_size (8192 MB), no_resume, device, progress. Returns a summary dict (output dir and files, bpw per
    layer kind, stage times, peak memory). Without out_dir a temporary work dir is used and removed on success.
    """
    s = ConvertSettings(in_dir=in_dir, out_dir=out_dir, compile_dir=compile_dir, **kwargs)
    s.validate()
    if s.out_dir is not None:
        with writing(s.compile_dir or s.out_dir):  # a file-system error anywhere: typed, naming the file
            return _Converter(s).run()
    tmp = tempfile.mkdtemp(prefix="exlpy-convert-")
    s.out_dir = tmp
    try:
        with writing(s.compile_dir or tmp):
            result = _Converter(s).run()
    except BaseException:
        if os.path.exists(os.path.join(tmp, "job.json")):
            print(f"exlpy convert: the work dir {tmp} was kept; add -o {tmp} to resume the job", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return result


class _Converter:
    def __init__(self, s: ConvertSettings) -> None:
        self.s = s
        self.prog = StageProgress(s.progress, s.status_output)
        self.device = torch.device(s.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))

    # ------------------------------------------------------------------ setup
    def _open_model(self) -> None:
        s = self.s
        if s.in_dir is None:
            raise ConvertSettingsError("-i/--in_dir (the source model directory) is required")
        self.config = ExLlamaV2Config(s.in_dir)
        if s.rope_scale is not None:
            self.config.scale_pos_emb = float(s.rope_scale)
        if s.rope_alpha is not None:
            self.config.scale_alpha_value = float(s.rope_alpha)
        spec = self.config.spec
        assert spec is not None
        if spec.moe is not None and spec.arch.moe_fused_experts:  # DBRX: experts fused per layer in the source
            raise UnsupportedArchitectureError(f"converting {spec.architecture} to EXL2 is not supported (its "
                                               "experts are stored fused per layer); the fp16/bf16 model loads as "
                                               "it is")
        if spec.quant_method is not None:
            raise UnsupportedArchitectureError(f"{s.in_dir} is already quantized ({spec.quant_method}); convert "
                                               "from the fp16/bf16/fp32 model")
        self.model = ExLlamaV2(self.config)
        self.decoders = [m for m in self.model.modules if is_decoder(m)]
        for m in self.decoders:
            for k in shapes(m):
                if linear_format(self.config.index, f"{m.key}.{k}") != "dense":
                    raise UnsupportedArchitectureError(f"{m.key}.{k} is not a dense weight; convert from the "
                                                       "fp16/bf16/fp32 model")
        self.numel = sum(module_numel(m) for m in self.decoders)
        costs = [[module_bits(m, o) for o in OPTIONS[type(m)]] for m in self.decoders]
        lo, _ = reachable(costs, self.numel)
        if s.bits < lo:
            raise ConvertSettingsError(f"-b/--bits {s.bits} is below the cheapest option set of this model: the "
                                       f"reachable range is {lo:.3f} to {MAX_BPW:g} bits per weight")
        for name, length in (("-l/--length", s.length), ("-ml/--measurement_length", s.measurement_length)):
            if length > self.config.max_seq_len:
                raise ConvertSettingsError(f"{name} {length} exceeds the model's {self.config.max_seq_len} "
                                           "positions")

    def _store_for(self, rows: int, length: int) -> torch.device:
        if self.device.type != "cuda":
            return self.device
        need = 3 * rows * length * self.config.hidden_size * 2
        free, _ = torch.cuda.mem_get_info(self.device)
        return self.device if need < 0.3 * free else torch.device("cpu")

    def _chunk_rows(self, length: int) -> int:
        tokens = 16384 if self.device.type == "cuda" else 4096
        return max(1, tokens // length)

    def _cal(self, name: str, rows: int, length: int) -> torch.Tensor:
        path = self.job.path(name)
        if os.path.exists(path):
            from safetensors.torch import load_file

            return load_file(path)["input_ids"]
        ids = caldata.calibration_rows(self.s.cal_dataset, self.tokenizer, rows, length,
                                       self.config.vocab_size)
        write_tensors(path, {"input_ids": ids})
        return ids

    def _embed(self, ids: torch.Tensor, store: torch.device) -> States:
        emb = self.model.modules[0]
        emb.load(self.device)
        chunks = []
        step = self._chunk_rows(ids.shape[1])
        for a in range(0, ids.shape[0], step):
            x = ids[a:a + step].to(self.device)
            y = _run(emb, x, contiguous_batch(x.shape[0], x.shape[1], 0, None, 0, self.device))
            check_finite(y, "the embedding")
            chunks.append(y.to(store))
        emb.unload()
        return States(chunks)

    def _states(self, sd: dict[str, Any], ids: torch.Tensor, store: torch.device) -> States:
        if sd.get("states"):
            return States.from_dict(self.job.load_states(sd["states"]), store)
        return self._embed(ids, store)

    # ------------------------------------------------------------------ stages
    def run(self) -> dict[str, Any]:
        s = self.s
        if s.in_dir is None and s.out_dir and os.path.exists(os.path.join(s.out_dir, "job.json")):
            with open(os.path.join(s.out_dir, "job.json"), encoding="utf-8") as f:
                s.in_dir = json.load(f).get("settings", {}).get("in_dir")  # resume without -i, as exllamav2
        self._open_model()
        assert s.out_dir is not None
        self.job, resumed = Job.open(s.out_dir, s.fingerprint(), s.no_resume, keep=s.measurement)
        self.job.data.setdefault("job_id", uuid.uuid4().hex)
        if s.compile_dir:
            check_output_dir(s.compile_dir, self.job.data["job_id"], s.no_resume)
        if resumed:
            self.prog.print(f"Resuming job in {s.out_dir} at stage '{self.job.stage}'")
        self.tokenizer = caldata.open_tokenizer(s.in_dir)
        self.prefetch = SourcePrefetch()
        try:
            with torch.inference_mode():
                return self._stages()
        finally:
            self.prefetch.close()
            self.job.close()  # a failing job's background writes end before the caller retries

    def _stages(self) -> dict[str, Any]:
        s = self.s
        if "measurement" not in self.job.data:
            self.job.data["measurement"] = self._load_measurement() if s.measurement else self._measure()
            self.job.save()
        if s.objective == "sensitivity" and "sensitivity" not in self.job.data:
            self.job.data["sensitivity"] = self._sensitivity()
            self.job.save()
        if s.output_measurement:
            path = self.job.path("measurement.json")
            extra = {"sensitivity": self.job.data["sensitivity"]} if "sensitivity" in self.job.data else {}
            write_json(path, {"measurement": self.job.data["measurement"],
                              "last_module_idx": len(self.model.modules) - 1} | extra)
            self.prog.print(f"Measurement written to {path}")
            return {"measurement": path, "times": self.job.data["times"], "peak": peak_memory()}
        if s.objective == "kl" and "kl_weights" not in self.job.data:
            self.job.data["kl_weights"] = self._kl_weights()
            self.job.save()
        if "strategy" not in self.job.data:
            self._optimize()
        if not self.job.data.get("quant", {}).get("head_done"):
            self._quantize()
        result = self._compile()
        self.prog.print(summary_table(result))
        return result

    def _prefetch(self, idx: int) -> None:
        """Decoder idx's source check done (or waited for), the next one's started in the background."""
        self.prefetch.ready(self.decoders[idx])
        if idx + 1 < len(self.decoders):
            self.prefetch.start(self.decoders[idx + 1])

    def _timed(self, stage: str, t0: float) -> None:
        self.job.add_time(stage, time.perf_counter() - t0)

    def _measure(self) -> dict[str, list[dict[str, Any]]]:
        s, job = self.s, self.job
        ids = self._cal("cal_measure.safetensors", s.measurement_rows, s.measurement_length)
        self.prog.step("tokenize (measure)")
        md = job.data.setdefault("measure", {"next": 0, "states": None, "measurement": {}, "module_times": {}})
        store = self._store_for(s.measurement_rows, s.measurement_length)
        t0 = time.perf_counter()
        states = self._states(md, ids, store)
        self.prog.start("measure", len(self.decoders), md["next"])
        for idx in range(md["next"], len(self.decoders)):
            m = self.decoders[idx]
            t1 = time.perf_counter()
            self._prefetch(idx)
            m.load(self.device)
            measure = measure_moe if isinstance(m, MoEMLP) else measure_module
            entries, states = measure(m, states, self.device, store, s.damp, s.scale_norm)  # type: ignore[arg-type]
            m.unload()
            md["measurement"][m.key] = entries
            md["module_times"][m.key] = time.perf_counter() - t1
            best = max(e["accuracy"] for e in entries)
            self.prog.advance(f"{m.key}  best accuracy {best:.5f}{_experts_note(entries[0])}")
            if isinstance(m, (MLP, MoEMLP)) or idx == len(self.decoders) - 1:
                job.flush()  # the previous checkpoint first, so each is saved with the time spent up to it
                self._timed("measure", t0)
                t0 = time.perf_counter()
                # Written while the next layer runs; recorded in job.json once on disk (job.py).
                job.checkpoint_async("measure", idx, states.to_dict(host=False))
            job.poll()
        job.flush()
        self._timed("measure", t0)
        self.prog.finish()
        job.drop_states(md.get("states"))
        return md["measurement"]

    def _sensitivity(self) -> dict[str, float]:
        """Per-module weights of the objective (exlpy/convert/sensitivity.py): from the measurement file when it
        has them (one made by `exlpy convert -om`), else measured on the first `sensitivity_tokens` calibration
        tokens."""
        if self.s.measurement:
            with open(self.s.measurement, encoding="utf-8") as f:
                saved = json.load(f).get("sensitivity")
            if isinstance(saved, dict) and all(isinstance(saved.get(m.key), (int, float)) for m in self.decoders):
                return {m.key: float(saved[m.key]) for m in self.decoders}
        t0 = time.perf_counter()
        self.prog.note("sensitivity")
        ids = self._cal("cal_measure.safetensors", self.s.measurement_rows, self.s.measurement_length)
        n = self.s.sensitivity_tokens
        length = min(ids.shape[1], n)
        ids = ids[:max(1, n // length), :length]
        sens = module_sensitivity(self.model.modules, self._embed(ids, self.device), self.device)
        self.prog.step("sensitivity")
        self._timed("sensitivity", t0)
        return sens

    def _load_measurement(self) -> dict[str, list[dict[str, Any]]]:
        path = self.s.measurement
        assert path is not None
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)["measurement"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MeasurementFileError(f"{path}: not a measurement file ({e})") from e
        for m in self.decoders:
            entries = data.get(m.key)
            if not isinstance(entries, list) or not entries:
                raise MeasurementFileError(f"{path} has no entries for {m.key}: it was measured on another model")
            for e in entries:
                try:
                    qps = {k: QParams.from_dict(e[k]) for k in slots(m)}
                    float(e["accuracy"])
                except (KeyError, ValueError, TypeError) as exc:
                    raise MeasurementFileError(f"{path}: malformed entry for {m.key} ({exc})") from exc
                mine = module_bits(m, qps)
                if abs(mine - float(e.get("total_bits", mine))) > 0.02 * mine:
                    raise MeasurementFileError(f"{path}: {m.key} has {e.get('total_bits')} bits for an option that "
                                               f"costs {mine} bits on this model: it was measured on another model")
                e["total_bits"] = mine
        extra = set(data) - {m.key for m in self.decoders}
        if extra:
            raise MeasurementFileError(f"{path} measures modules this model lacks ({sorted(extra)[0]}, ...): it "
                                       "was measured on another model")
        return {m.key: data[m.key] for m in self.decoders}

    def _choice(self, weights: dict[str, float] | None) -> list[int]:
        """The option index per decoder module of least (weighted) total error within the bit budget."""
        meas = self.job.data["measurement"]
        costs = [[int(e["total_bits"]) for e in meas[m.key]] for m in self.decoders]
        errors = [[slot_error(e) * (weights[m.key] if weights else 1.0) for e in meas[m.key]] for m in self.decoders]
        budget = int(self.numel * self.s.bits)
        lo, _ = reachable(costs, self.numel)
        if budget < sum(min(c) for c in costs):
            raise ConvertSettingsError(f"-b/--bits {self.s.bits} is below the cheapest measured options: the "
                                       f"reachable range is {lo:.3f} to {MAX_BPW:g} bits per weight")
        return choose(costs, errors, budget)

    def _optimize(self) -> None:
        t0 = time.perf_counter()
        meas = self.job.data["measurement"]
        weights = {"sensitivity": self.job.data.get("sensitivity"), "kl": self.job.data.get("kl_weights")}.get(
            self.s.objective)
        choice = self._choice(weights)
        strategy = {}
        for m, c in zip(self.decoders, choice):
            e = meas[m.key][c]
            strategy[m.key] = {k: e[k] for k in slots(m)} | {"total_bits": int(e["total_bits"]), "option": c}
        self.job.data["strategy"] = strategy
        self.prog.step("optimize")
        self._timed("optimize", t0)
        self.job.set_stage("quant")

    def _kl_weights(self) -> dict[str, float]:
        """Weights of the "kl" objective: per module, the KL of the final next-token distribution per unit of
        measured error when that module alone is quantized with the option the plain objective picks at this
        bpw (the operating point), everything else at source precision; on the first `sensitivity_tokens`
        measurement tokens, GPTQ without learned rounding (exlpy/convert/sensitivity.py)."""
        s = self.s
        t0 = time.perf_counter()
        self.prog.note("KL weights")
        meas = self.job.data["measurement"]
        options = {m.key: {k: QParams.from_dict(meas[m.key][c][k]) for k in slots(m)}
                   for m, c in zip(self.decoders, self._choice(None))}
        ids = self._cal("cal_measure.safetensors", s.measurement_rows, s.measurement_length)
        length = min(ids.shape[1], s.sensitivity_tokens)
        ids = ids[:max(1, s.sensitivity_tokens // length), :length]

        def perturb(m: Module, x: States, out: States) -> tuple[States, float]:
            if isinstance(m, MoEMLP):
                _, q, _, _ = quantize_moe(m, x, self.device, self.device, options[m.key], s.damp, s.scale_norm,
                                          s.act_order)
            else:
                _, q, _, _ = quantize_module(m, x, self.device, self.device, options[m.key], s.damp, s.scale_norm,
                                             s.act_order)
            return q, token_error(q, out)

        weights = module_sensitivity(self.model.modules, self._embed(ids, self.device), self.device,
                                     perturb=perturb)
        self.prog.step("KL weights")
        self._timed("kl_weights", t0)
        return weights

    def _quantize(self) -> None:
        s, job = self.s, self.job
        ids = self._cal("cal_quant.safetensors", s.rows, s.length)
        self.prog.step("tokenize (quantize)")
        qd = job.data.setdefault("quant", {"next": 0, "states": None, "errors": {}, "module_times": {}})
        store = self._store_for(s.rows, s.length)
        os.makedirs(job.path("out_tensor"), exist_ok=True)
        t0 = time.perf_counter()
        states = self._states(qd, ids, store)
        # The source model's states beside the quantized ones: the target of asymmetric calibration.
        ref = None
        if s.target == "source":
            ref = (States.from_dict(self.job.load_states(qd["states"]), store, "ref_") if qd.get("states")
                   else States(list(states.chunks), states.side))
        self.prog.start("quantize", len(self.decoders) + 1, qd["next"])
        for idx in range(qd["next"], len(self.decoders)):
            m = self.decoders[idx]
            t1 = time.perf_counter()
            option = {k: QParams.from_dict(v) for k, v in job.data["strategy"][m.key].items()
                      if isinstance(v, dict)}
            self._prefetch(idx)
            m.load(self.device)
            note = ""
            if isinstance(m, MoEMLP):
                if ref is not None:  # the source output first: quantizing the experts replaces their stacks
                    ref = forward_chunks(m, ref, self.device, store, m.key)
                tensors, states, rfn, tokens = quantize_moe(m, states, self.device, store, option, s.damp,
                                                            s.scale_norm, s.act_order)
                qd.setdefault("expert_tokens", {})[m.key] = tokens
                note = _experts_note({"expert_tokens": tokens})
            else:
                tensors, states, ref, rfn = quantize_module(m, states, self.device, store, option, s.damp,
                                                            s.scale_norm, s.act_order, ref, s.learned_rounding,
                                                            s.block_tune, s.block_tune_tokens, s.block_tune_norms)
            m.unload()
            job.write_async(job.path("out_tensor", f"{m.key}.safetensors"), tensors)
            qd["errors"][m.key] = rfn
            qd["module_times"][m.key] = time.perf_counter() - t1
            self.prog.advance(f"{m.key}  rel. error {rfn:.5f}{note}")
            if isinstance(m, (MLP, MoEMLP)) or idx == len(self.decoders) - 1:
                job.flush()
                self._timed("quantize", t0)
                t0 = time.perf_counter()
                keep = states.to_dict(host=False) | (ref.to_dict("ref_", host=False) if ref is not None else {})
                job.checkpoint_async("quant", idx, keep)
            job.poll()
        t1 = time.perf_counter()
        self.prog.note("lm_head")
        self._quantize_head(states, ref)
        job.flush()  # the last layers' files are on disk before the stage is marked done
        qd["module_times"]["lm_head"] = time.perf_counter() - t1
        qd["head_done"] = True
        self._timed("quantize", t0)
        job.set_stage("compile")
        job.drop_states(qd.get("states"))
        self.prog.advance("lm_head")
        self.prog.finish()

    def _quantize_head(self, states: States, ref: States | None) -> None:
        norm = self.model.modules[-2]
        norm.load(self.device)
        h, cross = head_hessian(norm, states, self.device, ref)
        x = module_input(states.chunks[0][:1], self.device)
        sample = _run(norm, x, contiguous_batch(1, x.shape[1], 0, None, 0, self.device))[0]
        norm.unload()
        spec = self.config.spec
        assert spec is not None
        name = "lm_head.weight" if "lm_head.weight" in self.config.index else "model.embed_tokens.weight"
        widest = max(k * n for m in self.decoders for k, n in shapes(m).values())
        cols = max(32, widest // spec.hidden_size // 32 * 32)
        tensors, err = quantize_head(self.config.index, name, h, self.s.head_bits, self.device, cols,
                                     self.s.damp, self.s.scale_norm, sample, spec.features.norm_head, cross)
        write_tensors(self.job.path("out_tensor", "lm_head.safetensors"), tensors)
        self.job.data["quant"]["head_error"] = err

    def _compile(self) -> dict[str, Any]:
        s, job = self.s, self.job
        t0 = time.perf_counter()
        self.prog.start("compile", 1)
        out_dir = s.compile_dir or s.out_dir
        assert out_dir is not None
        files = [job.path("out_tensor", f"{m.key}.safetensors") for m in self.decoders]
        files.append(job.path("out_tensor", "lm_head.safetensors"))
        quantized = {f"{m.key}.{k}" for m in self.decoders for k in shapes(m)} | {"lm_head"}
        # MoE blocks keep the source's tensor names (Mixtral's block_sparse_moe.*): exllamav2 loads the output too
        moe = [m.key for m in self.decoders if isinstance(m, MoEMLP)]
        names = compile_output(self.config.index, files, quantized, out_dir, s.shard_size,
                               stored_names(self.config.index, moe))
        if s.compile_dir:
            from exlpy import __version__

            cal = {"rows": s.rows, "length": s.length,
                   "dataset": os.path.basename(s.cal_dataset) if s.cal_dataset else "(default)"}
            write_model_dir(s.in_dir or "", s.compile_dir, {"quant_method": "exl2", "version": __version__,
                                                            "bits": s.bits, "head_bits": s.head_bits,
                                                            "calibration": cal}, job.data["job_id"])
        self.prog.advance("done")
        self.prog.finish()
        self._timed("compile", t0)
        job.data["stage"] = "finished"
        result = self._result(out_dir, names)
        job.data["result"] = result
        job.save()
        return result

    def _result(self, out_dir: str, names: list[str]) -> dict[str, Any]:
        strat = self.job.data["strategy"]
        kinds: dict[str, list[int]] = {"attention": [0, 0], "mlp": [0, 0]}
        for m in self.decoders:
            kind = "mlp" if isinstance(m, (MLP, MoEMLP)) else "attention"
            kinds[kind][0] += strat[m.key]["total_bits"]
            kinds[kind][1] += module_numel(m)
        total = sum(v[0] for v in kinds.values())
        spec = self.config.spec
        assert spec is not None
        from exlpy.convert.qparams import HEAD_OPTIONS

        head = HEAD_OPTIONS[self.s.head_bits].total_bits(spec.hidden_size, spec.vocab_size)
        q = self.job.data["quant"]
        errs = list(q.get("errors", {}).values())
        tokens = [t for per_layer in q.get("expert_tokens", {}).values() for t in per_layer]
        return {"min_expert_tokens": min(tokens) if tokens else None,
                "output_dir": out_dir, "files": names,
                "bpw": {k: bpw(v[0], v[1]) for k, v in kinds.items()} | {
                    "decoder": bpw(total, self.numel), "head": bpw(head, spec.hidden_size * spec.vocab_size)},
                "times": dict(self.job.data["times"]), "peak": peak_memory(),
                "head_error": q.get("head_error"), "mean_layer_error": sum(errs) / len(errs) if errs else None}


def _experts_note(entry: dict[str, Any]) -> str:
    """The calibration tokens an MoE block's experts got (fewest, most), for the progress line."""
    tokens = entry.get("expert_tokens")
    return f"  expert tokens {min(tokens)}-{max(tokens)}" if tokens else ""
