"""Export (DESIGN 7): BN folding, ONNX parity on real images, run-folder contract, engine errors, deploy runner, CLI."""

import gzip
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edgetl.cli import main as cli_main
from edgetl.errors import CapabilityError, ConfigError, DataError
from edgetl.export import (
    Preprocessing,
    build_engine,
    export_onnx,
    export_run,
    load_run_model,
    merge_for_inference,
)
from edgetl.export.exporter import STACK_TRACE, drop_stack_traces
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import build_network

FMNIST = Path("/usr/share/datasets/fashion-mnist")
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RES = 64
SPEC = BackboneSpec(width=0.35, num_classes=10, hidden={1: 5, 2: 10})
LABELS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
RECIPE = {"data": {"name": "fashion-mnist", "resolution": RES}, "optim": {"lr_side": 1e-3, "lr_head": 3e-4}}

needs_fmnist = pytest.mark.skipif(not (FMNIST / "t10k-images-idx3-ubyte.gz").is_file(),
                                  reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


def read_idx_images(path: Path, count: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        magic, n, rows, cols = np.frombuffer(f.read(16), dtype=">u4")
        assert magic == 2051
        return np.frombuffer(f.read(count * rows * cols), dtype=np.uint8).reshape(count, rows, cols)


def to_tensor(images: np.ndarray, prep: Preprocessing) -> torch.Tensor:
    """Grayscale uint8 -> RGB, bilinear to the resolution, normalised (an independent torch path)."""
    x = torch.from_numpy(images.astype(np.float32) / 255.0)[:, None].repeat(1, 3, 1, 1)
    x = nn.functional.interpolate(x, size=(prep.resolution, prep.resolution), mode="bilinear", align_corners=False)
    mean, std = torch.tensor(prep.mean).view(1, 3, 1, 1), torch.tensor(prep.std).view(1, 3, 1, 1)
    return (x - mean) / std


@pytest.fixture(scope="module")
def images():
    if not (FMNIST / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    return read_idx_images(FMNIST / "t10k-images-idx3-ubyte.gz", 48)


@pytest.fixture(scope="module")
def trained(images):
    """A repnet EdgeNet with real BN running statistics and non-zero side BN gammas."""
    torch.manual_seed(0)
    net = build_network(SPEC, mode="repnet")
    x = to_tensor(images[:32], Preprocessing(resolution=RES))
    with torch.no_grad():
        # torchvision's classifier init (std 0.01) gives logits ~0.05: too small for 1e-4 to mean much.
        net.classifier[-1].weight.normal_(0.0, 0.3)
        for m in net.side.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.normal_(1.0, 0.5)
                m.bias.normal_(0.0, 0.1)
        net.train()
        for i in range(4):
            net(x[i * 8:(i + 1) * 8] if i < 3 else x)
    net.eval()
    return net


@pytest.fixture(scope="module")
def run_dir(trained, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    (run / "model.json").write_text(json.dumps({
        "backbone": SPEC.to_dict(), "mode": "repnet", "labels": LABELS, "recipe": RECIPE,
        "preprocessing": {"resolution": RES},
    }))
    torch.save({"model": trained.state_dict(), "epoch": 1}, run / "best.pt")
    return run


@pytest.fixture(scope="module")
def exported(run_dir, images):
    images_t = to_tensor(images[32:40], Preprocessing(resolution=RES))
    return export_run(run_dir, images=images_t)


def test_bn_statistics_and_side_network_are_non_trivial(trained, images):
    bn = trained.features[3].conv[0][1]
    assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    x = to_tensor(images[:8], Preprocessing(resolution=RES))
    side = trained.side
    with torch.no_grad():
        with_side = trained(x)
        trained.side = None
        try:
            without_side = trained(x)
        finally:
            trained.side = side
    assert (with_side - without_side).abs().max() > 1e-2


def test_merged_equals_unmerged(trained, images):
    merged = merge_for_inference(trained)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in merged.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in trained.modules()), "the original must not change"
    x = to_tensor(images[:16], Preprocessing(resolution=RES))
    with torch.no_grad():
        ref, got = trained.eval()(x), merged(x)
    scale = ref.abs().max().item()
    assert scale > 1.0
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert torch.equal(got.argmax(1), ref.argmax(1))


def test_merged_activations_write_new_tensors_with_the_same_values(trained, images):
    """The inference copy's activations are out of place (the dynamo exporter decomposes an
    in-place one again for each, under symbolic shapes); the original keeps its in-place ones,
    and the outputs are the same to the bit either way."""
    merged = merge_for_inference(trained)
    flags = [m.inplace for m in merged.modules() if isinstance(getattr(m, "inplace", None), bool)]
    assert len(flags) >= 35 and not any(flags)  # MobileNetV2's ReLU6s and the side network's ReLUs
    assert any(getattr(m, "inplace", False) is True for m in trained.modules()), "the original must not change"
    x = to_tensor(images[:16], Preprocessing(resolution=RES))
    with torch.no_grad():
        out_of_place = merged(x)
        for m in merged.modules():
            if isinstance(getattr(m, "inplace", None), bool):
                m.inplace = True
        assert torch.equal(merged(x), out_of_place)


def test_load_run_model_round_trip(run_dir, trained, images):
    run = load_run_model(run_dir)
    assert run.labels == LABELS and run.mode == "repnet" and run.checkpoint.name == "best.pt"
    assert run.preprocessing.resolution == RES and run.preprocessing.resize == round(RES / 0.875)
    x = to_tensor(images[:4], Preprocessing(resolution=RES))
    with torch.no_grad():
        assert torch.equal(run.net(x), trained(x))


def test_onnx_parity_on_real_images(exported, trained, images):
    """onnxruntime vs the *unmerged* PyTorch network, batch 1 and 8, recomputed here."""
    import onnxruntime as ort

    assert set(exported.parity_max_abs_diff) == {1, 8}
    assert exported.max_abs_diff <= 1e-4
    session = ort.InferenceSession(str(exported.onnx_path), providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    assert inp.name == "image" and isinstance(inp.shape[0], str), "batch axis must be dynamic"
    x = to_tensor(images[40:48], Preprocessing(resolution=RES))
    for batch in (1, 8):
        got = session.run(None, {"image": x[:batch].numpy()})[0]
        with torch.no_grad():
            ref = trained(x[:batch]).numpy()
        assert got.shape == (batch, 10)
        assert np.abs(got - ref).max() <= 1e-4
    print(f"ONNX parity max abs diff: {exported.parity_max_abs_diff}, logits scale {np.abs(ref).max():.2f}")


def test_onnx_sidecar(exported, run_dir):
    import onnx

    meta = json.loads(exported.onnx_sidecar.read_text())
    assert exported.onnx_sidecar == Path(str(exported.onnx_path) + ".json")
    assert meta["labels"] == LABELS
    assert meta["preprocessing"] == {"resolution": RES, "resize": 73, "mean": [0.485, 0.456, 0.406],
                                     "std": [0.229, 0.224, 0.225], "channels": "RGB", "layout": "NCHW"}
    assert meta["input"]["name"] == "image" and meta["input"]["shape"] == ["batch", 3, RES, RES]
    expected_hash = hashlib.sha256(json.dumps(RECIPE, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert meta["source"]["recipe_hash"] == "sha256:" + expected_hash
    assert meta["source"]["run"] == str(run_dir.resolve()) and meta["source"]["checkpoint"] == "best.pt"
    model = onnx.load(str(exported.onnx_path))
    assert meta["opset"] == next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert max(float(v) for v in meta["parity"]["max_abs_diff"].values()) == exported.max_abs_diff
    assert exported.onnx_bytes == exported.onnx_path.stat().st_size


def test_exported_graph_has_no_batch_dependent_reshape(exported):
    """The pool and flatten export as one ReduceMean: torch 2.5's dynamo exporter with
    onnxscript 0.2.x cannot lower the flatten's reshape under a dynamic batch axis."""
    import onnx

    ops = {node.op_type for node in onnx.load(str(exported.onnx_path)).graph.node}
    assert "ReduceMean" in ops and not ops & {"Reshape", "Flatten", "GlobalAveragePool"}, ops


def test_export_refuses_non_finite_weights(trained, tmp_path, images):
    broken = merge_for_inference(trained)
    with torch.no_grad():
        broken.classifier[-1].weight[0, 0] = float("nan")
    x = to_tensor(images[:8], Preprocessing(resolution=RES))
    with pytest.raises(DataError, match="non-finite weights .*classifier"):
        export_onnx(broken, tmp_path / "m.onnx", resolution=RES, images=x)
    assert not list(tmp_path.iterdir())


def test_legacy_exporter_and_its_opset_limit(trained, tmp_path, images):
    merged = merge_for_inference(trained)
    x = to_tensor(images[:8], Preprocessing(resolution=RES))
    with pytest.raises(ConfigError, match="opset <= 20"):
        export_onnx(merged, tmp_path / "m.onnx", resolution=RES, opset=21, dynamo=False, images=x)
    result = export_onnx(merged, tmp_path / "m.onnx", resolution=RES, opset=17, dynamo=False, images=x)
    assert result.opset == 17 and result.max_abs_diff <= 1e-4


def test_run_folder_errors(tmp_path, run_dir):
    with pytest.raises(DataError, match="does not exist"):
        load_run_model(tmp_path / "nope")
    with pytest.raises(DataError, match="model.json is missing"):
        load_run_model(tmp_path)
    (tmp_path / "model.json").write_text((run_dir / "model.json").read_text())
    with pytest.raises(DataError, match="no checkpoint"):
        load_run_model(tmp_path)
    torch.save({"model": {"features.0.0.weight": torch.zeros(1)}}, tmp_path / "last.pt")
    with pytest.raises(DataError, match="does not fit the network model.json describes: .* missing"):
        load_run_model(tmp_path)
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="is damaged or not a plain checkpoint"):
        load_run_model(tmp_path)


def test_build_engine_without_tensorrt(exported, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` fail
    with pytest.raises(CapabilityError, match="tensorrt"):
        build_engine(exported.onnx_path, tmp_path / "m.engine", fp16=True, max_batch=8)
    assert not (tmp_path / "m.engine").exists()


def test_build_engine_without_gpu_is_a_capability_error(exported, tmp_path, monkeypatch):
    """TensorRT's Builder returns None (after logging 'CUDA initialization failure') without a GPU."""
    import types

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    fake = types.SimpleNamespace(Logger=Logger, Builder=lambda logger: None, __version__="10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(CapabilityError, match="CUDA initialization failure"):
        build_engine(exported.onnx_path, tmp_path / "m.engine")


def _tensorrt_gpu_reason() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "TensorRT is not installed here"
    if not torch.cuda.is_available():
        return "no CUDA GPU here"
    return None


@pytest.mark.tensorrt
@pytest.mark.skipif(_tensorrt_gpu_reason() is not None, reason=str(_tensorrt_gpu_reason()))
def test_engine_build_and_parity(exported, tmp_path, trained, images):
    meta = build_engine(exported.onnx_path, tmp_path / "m.engine", fp16=False, max_batch=8)
    data = (tmp_path / "m.engine").read_bytes()
    assert meta["engine_bytes"] == len(data) and not data.startswith(b"{"), "no metadata in front of the engine"
    sidecar = json.loads((tmp_path / "m.engine.json").read_text())
    assert sidecar["labels"] == LABELS and sidecar["batch"] == {"min": 1, "opt": 8, "max": 8}
    engine = _load_deploy("classify").EngineModel(tmp_path / "m.engine", max_batch=8)
    x = to_tensor(images[:8], Preprocessing(resolution=RES))
    with torch.no_grad():
        ref = trained(x).numpy()
    for batch in (1, 8):
        assert np.abs(engine(x[:batch].numpy()) - ref[:batch]).max() <= 1e-3


def _load_deploy(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(DEPLOY))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DEPLOY))
    return module


def test_deploy_preprocessing_matches_torchvision(images):
    from PIL import Image
    from torchvision import transforms

    classify = _load_deploy("classify")
    prep = Preprocessing(resolution=RES).to_dict()
    reference = transforms.Compose([
        transforms.Resize(prep["resize"]), transforms.CenterCrop(RES), transforms.ToTensor(),
        transforms.Normalize(prep["mean"], prep["std"]),
    ])
    for raw in images[:4]:
        image = Image.fromarray(raw).convert("RGB").resize((40, 30))  # non-square: exercises crop rounding
        got = classify.preprocess_image(image, prep)
        assert got.shape == (3, RES, RES)
        assert np.abs(got - reference(image).numpy()).max() <= 1e-5


def test_deploy_runner_without_torch(exported, trained, images, tmp_path):
    """The ONNX runner classifies PNG files in a process where importing torch fails."""
    from PIL import Image

    paths = []
    for i, raw in enumerate(images[:10]):
        paths.append(tmp_path / f"img{i}.png")
        Image.fromarray(raw).save(paths[-1])
    code = (
        "import sys, runpy; sys.modules['torch'] = None; "
        f"sys.argv = ['classify.py', '--model', {str(exported.onnx_path)!r}, '--top-k', '3', '--json', '--threads', '1', "
        f"*{[str(p) for p in paths]!r}]; runpy.run_path({str(DEPLOY / 'classify.py')!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["image"] for r in results] == [str(p) for p in paths]
    # Same input through PyTorch: PIL resize + crop (checked against torchvision above), then the net.
    classify = _load_deploy("classify")
    meta = json.loads(exported.onnx_sidecar.read_text())
    x = torch.from_numpy(classify.preprocess(paths, meta["preprocessing"]))
    with torch.no_grad():
        probs = torch.softmax(trained(x), dim=1).numpy()
    for r, p in zip(results, probs):
        top = r["top"][0]
        assert top["index"] == int(p.argmax()) and top["label"] == LABELS[top["index"]]
        assert abs(top["prob"] - float(p.max())) <= 1e-5
        assert len(r["top"]) == 3


def test_deploy_benchmark(exported):
    bench = _load_deploy("benchmark")
    rows = bench.benchmark(exported.onnx_path, [1, 8], iters=3, warmup=1, threads=1)
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["images_per_s"] > 0


def test_cli_export_prints_paths_and_parity(run_dir, tmp_path, capsys):
    out_path = tmp_path / "cli.onnx"
    assert cli_main(["export", "--run", str(run_dir), "-o", str(out_path)]) == 0
    text = capsys.readouterr().out
    assert str(out_path) in text and "parity" in text and "next:" in text
    meta = json.loads(Path(str(out_path) + ".json").read_text())
    for batch, diff in meta["parity"]["max_abs_diff"].items():
        assert f"batch {batch}: {diff:.2e}" in text
        assert diff <= 1e-4  # seeded random pixels here, not the real images


def test_cli_bad_input_exit_2(run_dir, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "model.json").write_text((run_dir / "model.json").read_text())
    assert cli_main(["export", "--run", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["export", "--run", str(run_dir), "--format", "tflite"]) == 2
    assert "unknown export format 'tflite'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert cli_main(["export", "--run", str(run_dir), "--format", "engine", "-o", str(tmp_path / "m.engine")]) == 2
    err = capsys.readouterr().err
    assert "TensorRT" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists(), "fail before the export, not after"
    with pytest.raises(SystemExit) as exc:
        cli_main(["export"])
    assert exc.value.code == 2


def test_the_onnx_file_holds_no_path_of_the_machine_that_exported_it(exported):
    """torch's dynamo exporter writes each node's Python stack (the exporting machine's file
    paths) into the model; export leaves those out and keeps the rest of the nodes' metadata."""
    import onnx

    data = exported.onnx_path.read_bytes()
    for folder in (Path(onnx.__file__).resolve().parents[1], Path(__file__).resolve().parents[1]):
        assert str(folder).encode() not in data, folder  # site-packages, this checkout
    keys = {p.key for node in onnx.load(str(exported.onnx_path)).graph.node for p in node.metadata_props}
    assert STACK_TRACE not in keys and "namespace" in keys


def test_stack_traces_are_dropped_inside_subgraphs_and_functions_too():
    from onnx import helper

    def node(name, **attrs):
        made = helper.make_node("Identity", ["x"], ["y"], name=name, **attrs)
        for key in (STACK_TRACE, "namespace"):
            made.metadata_props.add(key=key, value=f"{name} /home/someone/edgetl")
        return made

    def graph(*nodes):
        return helper.make_graph(list(nodes), "g", [], [])

    branch = graph(node("inner"))
    model = helper.make_model(graph(node("outer", then_branch=branch, else_branch=graph(node("other")))))
    model.functions.append(helper.make_function("local", "f", ["x"], ["y"], [node("body")], []))
    assert drop_stack_traces(model) == 4
    for nodes in (model.graph.node, model.graph.node[0].attribute[0].g.node, model.functions[0].node):
        assert [p.key for p in nodes[0].metadata_props] == ["namespace"]
