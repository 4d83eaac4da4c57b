"""torch's ONNX exporters for ``edgetl.export``: a network in, an ONNX file out, or one line
saying why not. Which opsets each exporter can be asked for is read from the installed torch,
onnx and onnxruntime (none is assumed); an exporter's failure, a write that fails, and the
exporter's warnings each have their place (one CapabilityError or ResourceError line, the log).
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import torch

from edgetl.errors import CapabilityError, ConfigError, EdgetlError
from edgetl.io import write_error

log = logging.getLogger(__name__)

INPUT_NAME = "image"
OUTPUT_NAME = "logits"


def _onnx_modules():
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise CapabilityError(
            f"ONNX export needs the 'onnx' and 'onnxruntime' packages ({exc.name} is missing); "
            "install edgetl with the export extra: pip install 'edgetl[export]'"
        ) from None
    return onnx, onnxruntime


def _first_line(exc: BaseException, limit: int = 200) -> str:
    line = next((s.strip() for s in str(exc).splitlines() if s.strip()), type(exc).__name__)
    return line if len(line) <= limit else line[: limit - 3] + "..."


@functools.lru_cache(maxsize=None)
def runtime_max_opset() -> int:
    """The highest ONNX opset the installed onnxruntime loads (the parity check and
    deploy/classify.py run the model there), probed with a one-node model per opset,
    from the highest the installed onnx package defines down."""
    onnx, ort = _onnx_modules()
    from onnx import TensorProto, helper

    value = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", value[:1], value[1:])
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a refused probe is expected: no error lines on stderr
    for version in range(onnx.defs.onnx_opset_version(), 0, -1):
        opsets = [helper.make_opsetid("", version)]
        try:
            model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # onnxruntime's errors derive from Exception only
            continue
        return version
    return 0


def opset_range(dynamo: bool) -> tuple[int, int, str]:
    """The opsets an export can be asked for, ``(lowest, highest, why)``, read from the
    installed torch exporter, onnx and onnxruntime (none is assumed).

    The dynamo exporter implements opset ``TORCHLIB_OPSET`` (18) and converts the graph to
    another: down-conversion fails on this network's ReduceMean (axes became an input in 18),
    after which torch keeps 18 and only logs it. The legacy exporter's range is torch's own.
    Above, the opset must be one onnxruntime loads, for the parity check and deploy.
    """
    import onnx
    from torch.onnx import _constants as torch_onnx

    runtime = runtime_max_opset()
    if dynamo:
        try:
            from torch.onnx._internal.exporter._constants import TORCHLIB_OPSET as low
        except ImportError:  # another torch layout: the written model's opset is still checked
            low = torch_onnx.ONNX_MIN_OPSET
        high = min(onnx.defs.onnx_opset_version(), runtime)
        why = (f"torch {torch.__version__}'s dynamo exporter implements opset {low} and up; "
               f"onnx {onnx.__version__} defines up to {onnx.defs.onnx_opset_version()}")
    else:
        low = torch_onnx.ONNX_MIN_OPSET
        legacy_max = getattr(torch_onnx, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", torch_onnx.ONNX_MAX_OPSET)
        high = min(legacy_max, runtime)
        why = f"torch {torch.__version__}'s legacy exporter supports {low} to {legacy_max}"
    return low, high, f"{why}; onnxruntime {_onnx_modules()[1].__version__} loads up to {runtime}"


def check_opset(opset: int | None, dynamo: bool) -> None:
    """Refuse, before any work, an opset the exporter cannot write or onnxruntime cannot load.

    Raises:
        ConfigError: ``opset`` is not an integer in ``opset_range(dynamo)``.
    """
    if opset is None:
        return
    exporter = "dynamo" if dynamo else "legacy"
    low, high, why = opset_range(dynamo)
    if not isinstance(opset, int) or isinstance(opset, bool) or not low <= opset <= high:
        other = ""
        if dynamo and isinstance(opset, int) and opset_range(False)[0] <= opset < low:
            other = " (--legacy-exporter writes lower opsets)"
        raise ConfigError(f"ONNX opset {opset!r} is not available with the {exporter} exporter; allowed: "
                          f"{low} <= opset <= {high}{other} ({why})")


def written_opset(model) -> int:
    """The default-domain opset an ONNX model imports (-1 if none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), -1)


# torch's dynamo exporter writes on every node the Python stack that made it: the absolute
# paths of the exporting machine's files (its folders, its user's name), in a model that is
# shipped, and a file whose size depends on the folder it was exported from
STACK_TRACE = "pkg.torch.onnx.stack_trace"


def drop_stack_traces(model) -> int:
    """Remove ``STACK_TRACE`` from the metadata of every node of ``model`` (an ``onnx``
    ModelProto: its graph, its functions and their subgraphs); returns how many were removed."""
    dropped = 0
    pending = [model.graph.node, *(f.node for f in model.functions)]  # node lists still to visit
    while pending:
        for node in pending.pop():
            kept = [p for p in node.metadata_props if p.key != STACK_TRACE]
            if len(kept) != len(node.metadata_props):
                dropped += len(node.metadata_props) - len(kept)
                del node.metadata_props[:]
                node.metadata_props.extend(kept)
            for attr in node.attribute:
                pending.extend([attr.g.node] if attr.HasField("g") else [])
                pending.extend(g.node for g in attr.graphs)
    return dropped


def _export_graph(net, x, path: Path, *, opset, dynamic_batch: bool, dynamo: bool) -> None:
    """Export with torch; an exporter that cannot do it is one CapabilityError line (the
    traceback goes to the log at debug level), a write that fails a ResourceError."""
    exporter = "dynamo" if dynamo else "legacy"
    try:
        # torch's warnings (tracer, opset < 11 resize) go to the log: the parity check measures what they warn of
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run_exporter(net, x, path, opset=opset, dynamic_batch=dynamic_batch, dynamo=dynamo)
        for w in caught:
            log.info("torch's %s exporter: %s", exporter, _first_line(w.message))
    except EdgetlError:
        raise
    except Exception as exc:
        log.debug("torch's %s exporter failed", exporter, exc_info=True)
        cause = exc if isinstance(exc, OSError) else exc.__context__ or exc.__cause__
        if isinstance(cause, OSError) and cause.errno is not None:
            raise write_error(path, cause) from None
        at = f" at opset {opset}" if opset is not None else ""
        raise CapabilityError(f"torch {torch.__version__}'s {exporter} exporter cannot export this network{at}: "
                              f"{_first_line(exc)}") from None


def _run_exporter(net, x, path: Path, *, opset, dynamic_batch: bool, dynamo: bool) -> None:
    if dynamo:
        try:
            import onnxscript  # noqa: F401  (the dynamo exporter needs it)
        except ImportError:
            raise CapabilityError(
                "torch's default (dynamo) ONNX exporter needs 'onnxscript': pip install onnxscript, "
                "or use the legacy exporter (dynamo=False)"
            ) from None
        dynamic_shapes = {"image": {0: torch.export.Dim("batch", min=1, max=4096)}} if dynamic_batch else None
        program = torch.onnx.export(
            net,
            (x,),
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=opset,
            dynamic_shapes=dynamic_shapes,
            external_data=False,
            verbose=False,
        )
        program.save(str(path), external_data=False)
    else:
        dynamic_axes = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}} if dynamic_batch else None
        torch.onnx.export(
            net,
            (x,),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=opset or 17,
            dynamic_axes=dynamic_axes,
            do_constant_folding=True,
        )
