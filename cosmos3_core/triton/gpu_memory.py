"""`cosmos3_gpu_memory_bytes{part, kind, of}`, exported by each stub for its part: the memory plan's entries
(`of="planned"`, one per kind, and `kind="total"`), what the process holds now (`of="in_use"`, `kind="total"`:
torch's reserved memory plus a CUDA context, 0 off CUDA) and the most it has held (`of="peak"`: torch's peak
reserved plus a CUDA context). The denoise stub also exports the
`server` part's plan (tritonserver's own process and its CUDA pool), which no stub of ours runs in.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ..memory import MemoryPlan, in_use_bytes, peak_bytes


class GpuMemoryMetric:
    def __init__(self, plan: MemoryPlan, parts: tuple[str, ...], labels: dict[str, str]):
        self._family = pb_utils.MetricFamily(
            name="cosmos3_gpu_memory_bytes",
            description="GPU memory by part and kind: the memory plan's (of=planned), the process's now (of=in_use) "
            "and at most (of=peak)",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self._metrics = []  # a Metric must outlive its setting
        for part in parts:
            kinds = {e.kind: 0 for e in plan.entries if e.part == part}
            for e in plan.entries:
                if e.part == part:
                    kinds[e.kind] += e.bytes
            for kind, nbytes in [*kinds.items(), ("total", plan.part_bytes(part))]:
                self._metrics.append(
                    self._family.Metric(labels={**labels, "part": part, "kind": kind, "of": "planned"})
                )
                self._metrics[-1].set(nbytes)
        held = {**labels, "part": parts[0], "kind": "total"}
        self._in_use = self._family.Metric(labels={**held, "of": "in_use"})
        self._peak = self._family.Metric(labels={**held, "of": "peak"})
        self.publish()

    def publish(self) -> None:
        self._in_use.set(in_use_bytes())
        self._peak.set(peak_bytes())
