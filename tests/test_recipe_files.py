"""Issue #29: recipe files are read safely: billion laughs, binary, non-UTF-8, too big, not a
mapping, a syntax error and the like end in one line naming the file, exit 2, no traceback, no
run folder, and the user's file is left byte for byte as it was."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgetl.finetune  # noqa: F401 - imported up front, so timings below are of the read alone
from edgetl.cli import main
from edgetl.errors import ConfigError
from edgetl.io import MAX_YAML_BYTES, read_yaml
from edgetl.recipe import RECIPE_DIR, load_recipe

GOOD = (RECIPE_DIR / "imagefolder.yaml").read_bytes()

LAUGHS = b"""lol1: &lol1 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
lol2: &lol2 [*lol1, *lol1, *lol1, *lol1, *lol1, *lol1, *lol1, *lol1, *lol1]
lol3: &lol3 [*lol2, *lol2, *lol2, *lol2, *lol2, *lol2, *lol2, *lol2, *lol2]
lol4: &lol4 [*lol3, *lol3, *lol3, *lol3, *lol3, *lol3, *lol3, *lol3, *lol3]
lol5: &lol5 [*lol4, *lol4, *lol4, *lol4, *lol4, *lol4, *lol4, *lol4, *lol4]
lol6: &lol6 [*lol5, *lol5, *lol5, *lol5, *lol5, *lol5, *lol5, *lol5, *lol5]
lol7: &lol7 [*lol6, *lol6, *lol6, *lol6, *lol6, *lol6, *lol6, *lol6, *lol6]
lol8: &lol8 [*lol7, *lol7, *lol7, *lol7, *lol7, *lol7, *lol7, *lol7, *lol7]
lol9: &lol9 [*lol8, *lol8, *lol8, *lol8, *lol8, *lol8, *lol8, *lol8, *lol8]
data:
  preset: imagefolder
  resolution: 64
  classes: *lol9
"""

# name -> (file bytes, what the one line says besides the file's name)
BAD = {
    "billion_laughs": (LAUGHS, "line 2: aliases (*lol1) are not allowed"),
    "merge_alias": (GOOD.replace(b"optim:\n", b"base: &b {name: adam}\noptim:\n  <<: *b\n"), "aliases (*b)"),
    "latin1": (GOOD.replace(b"# Your own", "# Café, your own".encode("latin-1")), "is not UTF-8 text (byte 0xe9 on line 1)"),
    "utf16": ("data: {}\n".encode("utf-16"), "is a binary file (NUL byte at offset 3)"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file (NUL byte at offset 8)"),
    "nul_in_text": (GOOD + b"\x00", f"is a binary file (NUL byte at offset {len(GOOD)})"),
    "too_big": (GOOD + b"#" * (MAX_YAML_BYTES - len(GOOD)) + b"\n", f"is larger than {MAX_YAML_BYTES} bytes"),
    "list": (b"- data\n- model\n", "the top level must be a mapping of keys to values, got list ['data', 'model']"),
    "scalar": (b"just some words\n", "the top level must be a mapping of keys to values, got str"),
    "empty": (b"# nothing but a comment\n\n", "is empty; allowed: a mapping of keys to values"),
    "syntax": (b"data:\n  preset: imagefolder\n  classes: [1, 2\nmodel: {}\n", "is not valid YAML (line 4, column 6)"),
    "tab_indent": (b"data:\n\tpreset: imagefolder\n", "is not valid YAML (line 2, column 1)"),
    "two_documents": (GOOD + b"---\n" + GOOD, "is not valid YAML"),
    "repeated_key": (GOOD + b"train:\n  epochs: 1\n", "key 'train' appears twice; allowed: each key once"),
    "deep": (b"data: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", "line 1: nested deeper than 32 levels"),
    "huge_int": (b"train:\n  seed: " + b"7" * 5000 + b"\n", "line 2: value '777"),
    "control_char": (b"data:\n  root: a\x07b\n", "line 2: character U+0007 is not allowed in YAML"),
    "python_tag": (b"data: !!python/object/apply:os.system ['touch pwned']\n", "is not valid YAML (line 1, column 7)"),
}


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def argv_for(command: str, recipe: Path, out: Path) -> list[str]:
    # a data folder that does not exist: a file wrongly accepted fails there instead of training
    no_data = str(out.parent / "no-data")
    if command == "finetune":
        return ["finetune", "--recipe", str(recipe), "--backbone", "mobilenet_v2:random", "--data", no_data,
                "-o", str(out)]
    return ["retrain", "--recipe", str(recipe), "--backbone", "mobilenet_v2", "--device", "cpu", "--data", no_data,
            "-o", str(out)]


def assert_one_line_refusal(code: int, err: str, path: Path, out: Path, needle: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgetl: error: "), err
    assert str(path) in lines[0] or path.name in lines[0], err
    assert needle in lines[0], err
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("name", sorted(BAD))
@pytest.mark.parametrize("command", ["finetune", "retrain"])
def test_bad_recipe_files_are_refused_in_one_line(name, command, tmp_path, capsys):
    content, needle = BAD[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    out = tmp_path / "run"
    start = time.perf_counter()
    code, err = run_cli(capsys, argv_for(command, path, out))
    seconds = time.perf_counter() - start
    assert_one_line_refusal(code, err, path, out, needle)
    assert path.read_bytes() == content
    assert seconds < 2.0, f"{name} took {seconds:.1f} s"
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_billion_laughs_is_refused_at_once_by_the_reader(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_bytes(LAUGHS)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"aliases \(\*lol1\) are not allowed"):
        load_recipe(path)
    assert time.perf_counter() - start < 0.5
    # a single alias is refused too: a recipe has no need for any
    path.write_bytes(b"a: &x 1\nb: *x\n")
    with pytest.raises(ConfigError, match=r"line 2: aliases \(\*x\) are not allowed; write the value out"):
        read_yaml(path, what="recipe")


def test_the_size_limit_is_inclusive(tmp_path):
    path = tmp_path / "padded.yaml"
    padded = GOOD + b"#" * (MAX_YAML_BYTES - len(GOOD) - 1) + b"\n"
    assert len(padded) == MAX_YAML_BYTES
    path.write_bytes(padded)
    assert load_recipe(path, {"data.root": "/x"}) == load_recipe("imagefolder", {"data.root": "/x"})


def test_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "secret.yaml"
    path.write_bytes(GOOD)
    path.chmod(0)
    try:
        try:
            open(path, "rb").close()
            pytest.skip("this user reads files without read permission (root)")
        except PermissionError:
            pass
        with pytest.raises(ConfigError, match=r"^cannot read recipe .*secret.yaml: permission denied$"):
            load_recipe(path)
    finally:
        path.chmod(0o644)


def test_valid_unusual_files_still_load(tmp_path):
    """A BOM, non-ASCII comments, CRLF line ends, an anchor that no alias uses: all fine."""
    path = tmp_path / "mine.yaml"
    text = GOOD.decode().replace("# Your own", "# Café — your own")
    path.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert load_recipe(path) == load_recipe("imagefolder")
    path.write_bytes(GOOD.replace(b"optim:\n", b"optim: &o\n"))
    assert load_recipe(path) == load_recipe("imagefolder")


def test_every_bundled_recipe_reads_through_the_safe_reader():
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        assert read_yaml(path, what="recipe") == yaml.safe_load(path.read_text())


def test_a_recipe_given_through_set_cannot_smuggle_aliases():
    from edgetl.recipe import parse_override

    key, value = parse_override("data.classes=[&a [1, 2], *a, *a]")
    assert value == "[&a [1, 2], *a, *a]"  # left as text, which the type check then refuses
    with pytest.raises(ConfigError, match=r"data.classes is '\[&a \[1, 2\], \*a, \*a\]'; allowed: a list of"):
        load_recipe("imagefolder", {key: value})


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                         st.dictionaries(st.sampled_from(["data", "model", "optim", "train", "distill", "x"]),
                                         st.recursive(st.none() | st.booleans() | st.floats() | st.integers()
                                                      | st.text(max_size=10),
                                                      lambda inner: st.lists(inner, max_size=3)
                                                      | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                                                      max_leaves=10)).map(
                                                          lambda d: yaml.safe_dump(d).encode())))
def test_any_file_is_refused_in_one_line_or_loads(content, tmp_path, capsys):
    """Whatever bytes a recipe file holds, the answer is one line (nothing here is a whole recipe)."""
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(content)
    out = tmp_path / "run"
    code, err = run_cli(capsys, argv_for("finetune", path, out))
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not out.exists()
    assert path.read_bytes() == content
