"""A plan for a CUDA device, as finetune runs it there: the step captured as CUDA graphs, which
reserve device memory beyond an eager run's (``edgetl.memory.cuda_step.captured_report``); the
plan says in a note whether its tensors and that still fit the tensor budget."""

from __future__ import annotations

from edgetl.plan.document import Plan
from edgetl.plan.verify import planned_network
from edgetl.units import MB

GRAPH_NOTE = "on the device finetune captures the step as CUDA graphs"


def graph_note(plan: Plan) -> str:
    """The note for ``plan`` on a Jetson Orin (sm87): the planned network (``planned_network``),
    its step traced on the meta device (no arithmetic) and replayed as ``CapturedStep`` runs it."""
    from edgetl.memory.cuda import JETSON_ORIN
    from edgetl.memory.cuda_step import captured_report

    net, step = planned_network(plan)
    report = captured_report(net, runtime_bytes=plan.predicted_bytes, resolution=plan.resolution,
                             batch_size=plan.chosen.batch_size, step=step, capability=JETSON_ORIN)
    budget = plan.tensor_budget_bytes
    verdict = ("within it" if report.total_bytes <= budget else
               "over it: finetune refuses the plan with graphs; add --eager, or plan for the larger figure")
    return (f"{GRAPH_NOTE}: they reserve a predicted {report.extra_bytes / MB:.1f} MB beyond an eager run, "
            f"{report.total_bytes / MB:.1f} MB with the tensors against the tensor budget {budget / MB:.1f} MB, "
            f"{verdict} (Jetson Orin)")
