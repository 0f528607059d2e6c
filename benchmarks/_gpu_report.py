"""The rows and the table of benchmarks/gpu_check.py, from its parts' results.

Only the standard library: the parent process formats what its workers sent.
"""

from __future__ import annotations

import re
import statistics
import time


def why_failed(error):
    """A failed child's exception line (or what stopped it), short enough for a table."""
    stopped = re.search(r"did not finish within \d+ s", str(error))
    if stopped:  # the last error in its output is not what stopped it
        return stopped.group(0)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exhausted)\b", line)]
    why = raised[-1] if raised else lines[0]
    return why if len(why) <= 200 else why[:197] + "..."


def memory_rows(result, runs):
    """The memory part's rows, or one per (model, dtype) saying why there are none."""
    if result["status"] == "ok":
        return result["rows"]
    return [dict(part="memory", model=name, dtype=dtype, config="all", status=result["status"],
                 error=result.get("error")) for name, dtype, _ in runs]


def oom_row(result, allocator):
    row = dict(part="oom_backoff", model="mlp", dtype="float32", config=allocator, **result)
    if result["status"] != "ok":
        return row
    events, steps = result["backoffs"], result["steps"]
    if not events:
        row["note"] = (f"no out-of-memory error: the whole batch trained with "
                       f"{result['ballast_mib']:.0f} MiB of ballast")
        return row
    normal = statistics.median(steps[1:]) if len(steps) > 1 else 0.0
    sizes = " → ".join(str(e["failed_micro_batch_size"]) for e in events)
    wait = result["failing_allocation"]
    row["step_s"] = steps[0]
    row["note"] = (
        f"backed off {sizes} → {result['final_micro_batch_size']}; the step took "
        f"{steps[0]:.2f} s (failed attempt {events[0]['failed_step_seconds']:.2f} s, rollback "
        f"{events[0]['recovery_seconds']:.3f} s), a normal one {normal:.3f} s; an allocation "
        f"that cannot fit failed after {wait['seconds']:.2f} s ({wait['error']})"
    )
    return row


def logical_row(result):
    row = dict(part="logical_devices", model="mlp", dtype="float32", config="2 x GPU:0",
               **result)
    if result["status"] == "ok":
        row["note"] = "; ".join(
            run.get("error") or (
                f"{run['device']}: {run['steps']} steps, step {run['step_s']:.3f} s, peak "
                f"{run['peak_mib']:.0f} MiB of {run['limit_mib']:.0f}, weights on "
                f"{run['weights_on']}")
            for run in result["runs"]) + f"; both in {result['wall_s']:.1f} s"
    return row


def logger_row(columns, gpu):
    nvml = sorted(k for k in columns or {} if "nvml" in k)
    row = dict(part="memory_logger", model="mlp", dtype="float32", config="MemoryLogger()",
               columns=columns)
    if columns is None:
        row["status"] = "failed: the memory part that reads it did not finish"
    elif not gpu:
        row["status"] = "skipped: NVML's columns need a GPU"
        row["note"] = "columns here: " + ", ".join(sorted(columns))
    else:
        row["status"] = "ok" if nvml else "failed: no NVML columns"
        row["note"] = ", ".join(f"{k} {v:.0f}" for k, v in sorted(columns.items()))
    return row


def _figure(value, digits=None, suffix=""):
    if value is None:
        return ""
    if digits is None:  # MiB: whole ones where large, two decimals where tiny
        digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 1 else 2
    return f"{value:.{digits}f}{suffix}"


def table(found, scale, rows, seconds):
    """The run as one markdown table, under a line saying where it ran."""
    where = ", ".join(found["gpus"]) if found and found["gpus"] else "no GPU (CPU allocator)"
    versions = (f"TensorFlow {found['tensorflow']}, Keras {found['keras']}" if found
                else "TensorFlow did not start")
    lines = [
        f"# {time.strftime('%Y-%m-%d')}: {where}; {versions}; scale {scale}; {seconds:.0f} s",
        "",
        "| part | model | dtype | configuration | peak MiB | peak vs plain | NVML used MiB "
        "| step s | step vs plain | status, notes |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        note = row["status"] if row["status"] != "ok" else ""
        extra = row.get("note") or row.get("remat_choice") or ""
        note = "; ".join(part for part in (note, extra) if part)
        lines.append(
            f"| {row['part']} | {row['model']} | {row['dtype']} "
            f"| {row.get('label', row['config'])} | {_figure(row.get('peak_mib'))} "
            f"| {_figure(row.get('peak_vs_plain'), 2, 'x')} "
            f"| {_figure(row.get('nvml_used_mib'))} | {_figure(row.get('step_s'), 3)} "
            f"| {_figure(row.get('step_vs_plain'), 2, 'x')} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines)
