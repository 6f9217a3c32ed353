"""Issue 13, "done when": nothing of the user's is ever deleted or overwritten by any command.

Every command that writes runs against a folder seeded with a user's files, named as sdplan names its own
(a hand-written sdplan.yaml and accelerate.yaml, checkpoints/, samples/, loss.png, a dataset/ of images) and
with no manifest (``.sdplan-manifest.json``): as --out, --save, --store and export targets, with and without
--force. Afterwards every seeded file is compared byte for byte, and each command must have done what it says
(refused with its exit code, or written only new files).
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

import pytest
import yaml
from conftest import MACHINES, digest, make_images
from typer.testing import CliRunner

from sdplan import runfolder
from sdplan.cli import app

runner = CliRunner()
SNAPSHOT = MACHINES / "rtx3060_12gb.json"


def user_config(tiny_model: Path, dataset: Path) -> str:
    """A hand-written sdplan.yaml: valid, in the user's own layout and comments (not sdplan's rendering)."""
    return (
        "# my settings - do not lose\n"
        "method: lora\n"
        f"model: {{path: {tiny_model}}}\n"
        f"data: {{path: {dataset}, resolution: 64}}\n"
        "training: {max_steps: 2, precision: fp32}\n"
    )


def seed(root: Path, tiny_model: Path) -> Path:
    """The user's folder: sdplan's own names, the user's bytes, no manifest."""
    user = root / "user"
    make_images(user / "dataset", n=3)
    (user / "sdplan.yaml").write_text(user_config(tiny_model, user / "dataset"))
    (user / "accelerate.yaml").write_text("# my accelerate settings\ndistributed_type: NO\n")
    (user / "checkpoints").mkdir()
    (user / "checkpoints" / "x.safetensors").write_bytes(
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(64)
    )
    (user / "samples").mkdir()
    (user / "samples" / "grid.png").write_bytes(b"\x89PNG my sample grid")
    (user / "loss.png").write_bytes(b"\x89PNG my loss curve")
    (user / "run_summary.json").write_text('{"mine": true}\n')
    (user / "machine.json").write_text('{"my": "snapshot"}\n')
    (user / "export.yaml").write_text("my: export\n")
    # A folder holding only the user's own sdplan.yaml: training it in place must not rewrite it.
    (user / "proj").mkdir()
    (user / "proj" / "sdplan.yaml").write_text(user_config(tiny_model, user / "dataset"))
    return user


def record_a_measurement() -> None:
    """A real (not demo) point in the local profile store, so that `profiles export` has something to write."""
    from sdplan import config as C
    from sdplan.launcher import oom_point, record_point
    from sdplan.profiles import local_dir

    point = oom_point(
        C.validate(C.default_config()),
        {"step": 1},
        family="sd15",
        gpu_name="NVIDIA GeForce RTX 3060",
        gpu_memory_bytes=12 * 2**30,
        when=_dt.datetime(2026, 1, 1),
    )
    record_point(point, "lora", local_dir())


# (id, arguments with {user}/{model} placeholders, exit code, paths under {user} it must create; None: none)
CASES = [
    ("doctor-save-over-a-user-file", "doctor --machine {snap} --save {user}/machine.json", 3, None),
    ("doctor-save-new-file", "doctor --machine {snap} --save {user}/new-machine.json", 0, ["new-machine.json"]),
    ("recommend-out", "recommend --method lora --machine {snap} --out {user}", 3, None),
    ("recommend-out-force", "recommend --method lora --machine {snap} --out {user} --force", 3, None),
    ("recommend-out-force-own-config", "recommend --method lora --machine {snap} --out {user}/proj --force", 3, None),
    ("recommend-out-new", "recommend --method lora --machine {snap} --out {user}/plan", 0, ["plan/sdplan.yaml"]),
    ("train-dry-run", "train --model {model} --dataset {user}/dataset --out {user} --device cpu --dry-run", 3, None),
    ("train-dry-run-force", "train --model {model} --dataset {user}/dataset --out {user} --device cpu --dry-run --force", 3, None),
    ("train-dry-run-new", "train --model {model} --dataset {user}/dataset --out {user}/run --device cpu --dry-run", 0, None),
    ("train-out-in-dataset", "train --model {model} --dataset {user}/dataset --out {user}/dataset/run --device cpu --dry-run", 2, None),
    ("train-demo-dry-run", "train --demo --dry-run --out {user}", 3, None),
    ("train-demo-dry-run-force", "train --demo --dry-run --out {user} --force", 3, None),
    ("train-demo-dry-run-new", "train --demo --dry-run --out {user}/demo", 0, None),
    ("train-demo-into-user-folder", "train --demo --out {user}", 3, None),
    ("train-demo-force", "train --demo --out {user} --force", 3, None),
    ("train-resume-foreign", "train --resume --out {user}", 2, None),
    ("train-config-force", "train --config {user}/sdplan.yaml --out {user} --force --device cpu --yes", 3, None),
    ("train-own-config-in-place", "train --config {user}/proj/sdplan.yaml --out {user}/proj --device cpu --yes", 3, None),
    ("train-own-config-in-place-force", "train --config {user}/proj/sdplan.yaml --out {user}/proj --force --device cpu --yes", 3, None),
    ("train-own-config-in-place-dry-run", "train --config {user}/proj/sdplan.yaml --out {user}/proj --device cpu --dry-run", 3, None),
    ("bench-demo-store", "bench --demo --store {user}", 0, ["methods/lora.yaml"]),
    ("profiles-export-over-a-user-file", "profiles export {user}/export.yaml", 3, None),
    ("profiles-export-new", "profiles export {user}/measured.yaml", 0, ["measured.yaml"]),
    ("profiles-export-into-a-missing-folder", "profiles export {user}/shared/measured.yaml", 2, None),
]  # fmt: skip
SLOW_CASES = [
    ("train-demo-new", "train --demo --out {user}/demo-run", 0, ["demo-run/run_summary.json"]),
    (
        "train-on-the-users-dataset",
        "train --model {model} --dataset {user}/dataset --out {user}/run --device cpu --yes "
        "training.max_steps=2 data.resolution=64 training.precision=fp32 sampling.num_inference_steps=2",
        0,
        ["run/run_summary.json"],
    ),
]


def _check(tmp_path, tiny_sd15, args: str, code: int, creates: list[str] | None) -> None:
    user = seed(tmp_path, tiny_sd15)
    record_a_measurement()
    before = digest(user)
    argv = args.format(user=user, model=tiny_sd15, snap=SNAPSHOT).split()
    r = runner.invoke(app, argv)
    assert r.exit_code == code, (r.exit_code, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stdout + r.stderr
    if code != 0:
        assert r.stderr.strip().startswith("error: "), r.stderr
    after = digest(user)
    changed = [name for name, h in before.items() if after.get(name) != h]
    assert not changed, f"{args}: changed or deleted the user's {changed}"
    new = sorted(set(after) - set(before))
    if creates is None:
        assert not new, f"{args}: wrote {new}"
    else:
        for path in creates:
            assert path in new, (path, new)
        top = {Path(n).parts[0] for n in new}
        assert top <= {Path(c).parts[0] for c in creates}, f"{args}: wrote {new} beside {creates}"
    assert not (user / runfolder.MANIFEST_FILE).exists()  # the user's folder never became sdplan's


@pytest.mark.parametrize(("args", "code", "creates"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_no_command_touches_the_users_files(tmp_path, tiny_sd15, args, code, creates):
    _check(tmp_path, tiny_sd15, args, code, creates)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "creates"), [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES]
)
def test_no_training_run_touches_the_users_files(tmp_path, tiny_sd15, args, code, creates):
    _check(tmp_path, tiny_sd15, args, code, creates)


def test_train_rewrites_its_own_planned_config_but_never_a_hand_written_one(tmp_path, tiny_sd15):
    """The gap this file found: `train --config proj/sdplan.yaml --out proj` rewrote the user's hand-written
    sdplan.yaml (comments and layout lost). A config `sdplan recommend --out` wrote (in the manifest), or one
    whose bytes are what train would write, is still trained in place."""
    from sdplan.launcher import UI, TrainRequest, run

    user = seed(tmp_path, tiny_sd15)
    # 1. the user's file: refused before anything is written
    req = TrainRequest(
        config=str(user / "proj" / "sdplan.yaml"), out=str(user / "proj"), device="cpu", dry_run=True
    )
    from sdplan.errors import OutputExistsError

    with pytest.raises(OutputExistsError, match="sdplan.yaml.*not written by sdplan"):
        run(req, UI(echo=lambda s: None))
    # 2. sdplan's own (the manifest lists it): the dry run goes through to the launch command
    proj = tmp_path / "planned"
    proj.mkdir()
    (proj / "sdplan.yaml").write_text((user / "proj" / "sdplan.yaml").read_text())
    runfolder.record(proj, ["sdplan.yaml"])
    lines: list[str] = []
    run(
        TrainRequest(config=str(proj / "sdplan.yaml"), out=str(proj), device="cpu", dry_run=True),
        UI(echo=lines.append),
    )
    assert any(line.startswith("dry run: would run") for line in lines)
    data = yaml.safe_load((proj / "sdplan.yaml").read_text())
    assert data["training"]["max_steps"] == 2


def test_an_edited_plan_is_kept_aside_when_sdplan_writes_it_again(tmp_path):
    """`recommend --out proj`, then the user edits proj/sdplan.yaml (notes, a learning rate) and plans again
    with --force, or trains it in place with a key=value override: sdplan rewrote the file and the edits were
    gone. Now a run file that no longer holds what sdplan wrote is copied aside first, and said so."""
    proj = tmp_path / "proj"
    plan = ["recommend", "--method", "lora", "--machine", str(SNAPSHOT), "--out", str(proj)]
    assert runner.invoke(app, plan).exit_code == 0
    edited = "# my notes: lr tuned by hand\n" + (proj / "sdplan.yaml").read_text()
    (proj / "sdplan.yaml").write_text(edited)

    r = runner.invoke(app, [*plan, "--force"])
    assert r.exit_code == 0, r.output
    copies = sorted(proj.glob("sdplan.edited-*.yaml"))
    assert len(copies) == 1 and copies[0].read_text() == edited
    assert (
        f"kept the sdplan.yaml that was there as {copies[0]}: it was not what sdplan last wrote" in r.stderr
    )
    assert not (proj / "sdplan.yaml").read_text().startswith("# my notes")  # the new plan
    assert not list(proj.glob("accelerate.edited-*")) and not list(proj.glob("plan.edited-*"))  # not edited
    # the copy is the user's: --force never deletes it, and the folder is still a plan to train in place
    assert copies[0].name in runfolder.kept(proj) and copies[0].name not in runfolder.owned(proj)
    assert copies[0].name not in runfolder.entries(proj)

    r = runner.invoke(app, [*plan, "--force"])  # nothing edited since: nothing kept
    assert r.exit_code == 0 and "kept the" not in r.stderr
    assert len(list(proj.glob("sdplan.edited-*.yaml"))) == 1


def test_train_in_place_keeps_the_users_edits_to_a_planned_config(tmp_path):
    from sdplan.launcher import UI, TrainRequest, command_line, launch_for, prepare, write_run_files

    proj = tmp_path / "proj"
    ds = make_images(tmp_path / "ds", n=2)
    plan = [
        "recommend",
        "--method",
        "lora",
        "--machine",
        str(SNAPSHOT),
        "--dataset",
        str(ds),
        "--out",
        str(proj),
    ]
    assert runner.invoke(app, plan).exit_code == 0
    text = (proj / "sdplan.yaml").read_text()
    edited = "# my notes\n" + re.sub(
        r"(?m)^(\s+)learning_rate: .*$", r"\1learning_rate: 0.0003  # mine", text
    )
    (proj / "sdplan.yaml").write_text(edited)
    req = TrainRequest(
        config=str(proj / "sdplan.yaml"),
        out=str(proj),
        device="cpu",
        overrides=["training.max_steps=1"],
        dry_run=True,  # the planned hub model's weights are not here (the suite runs offline)
    )
    p = prepare(req, UI(echo=lambda s: None))
    assert p.cfg.training.learning_rate == 0.0003
    written, copies = write_run_files(p.out, p.cfg, launch_for(p, req, p.resume), command_line(req, p.out))
    assert len(copies) == 1 and copies[0].read_text() == edited
    assert yaml.safe_load((proj / "sdplan.yaml").read_text())["training"]["max_steps"] == 1


def test_recommend_out_over_the_users_files_does_not_offer_force(tmp_path, tiny_sd15):
    """It said "already holds sdplan.yaml, accelerate.yaml (pass --force to overwrite)", and --force was then
    refused: the first answer is the last one."""
    user = seed(tmp_path, tiny_sd15)
    r = runner.invoke(app, ["recommend", "--method", "lora", "--machine", str(SNAPSHOT), "--out", str(user)])
    assert r.exit_code == 3
    assert "not written by sdplan" in r.stderr and "choose another --out" in r.stderr
    assert "--force" not in r.stderr


def test_a_write_that_fails_midway_claims_only_what_it_wrote(tmp_path, monkeypatch):
    """The disk filled up after sdplan.yaml: the manifest listed accelerate.yaml and deepspeed.json as sdplan's
    too, so a deepspeed.json the user put there later would have been written over."""
    import errno

    from sdplan.errors import SdplanError

    real = Path.write_bytes

    def full(self, data):
        if self.name.startswith("accelerate.yaml"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    files = {"sdplan.yaml": "method: lora\n", "accelerate.yaml": "x: 1\n", "deepspeed.json": "{}\n"}
    with pytest.raises(SdplanError, match="disk full"):
        runfolder.write_files(tmp_path, files)
    assert runfolder.owned(tmp_path) == {"sdplan.yaml"}
