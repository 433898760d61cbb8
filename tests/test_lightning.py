"""ckptio.integrations.lightning: a tiny LightningModule trained on CPU, checkpointed to S3 (moto) by
ModelCheckpoint through ckptio, resumed by a fresh Trainer, ends bitwise where an uninterrupted run does."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

import ckptio

pl = pytest.importorskip("pytorch_lightning", reason="the lightning extra (requirements/dev.txt pins it)")

from ckptio.integrations.lightning import CkptioAsyncCheckpointIO, CkptioCheckpointIO  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, STOP = 4, 2  # the interrupted run stops after STOP epochs and resumes to EPOCHS


class Tiny(pl.LightningModule):
    def __init__(self, seed: int, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # in the checkpoint as Lightning writes it
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)  # 4 steps an epoch


def _fit(model, max_epochs, plugins=(), callbacks=(), ckpt_path=None) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        plugins=list(plugins),
        callbacks=list(callbacks),
    )
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def uninterrupted():
    model = Tiny(seed=1)
    trainer = _fit(model, EPOCHS)
    return model.state_dict(), trainer.optimizers[0].state_dict(), trainer.global_step


def _state_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _state_equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("ext", [".fpk", ".pt", ".ckpt"])
@pytest.mark.parametrize("io_class", [CkptioCheckpointIO, CkptioAsyncCheckpointIO])
def test_resume_from_s3_matches_an_uninterrupted_run_bitwise(
    s3_uri, s3_endpoint, monkeypatch, uninterrupted, ext, io_class
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # ModelCheckpoint lists its directory with s3fs
    root = f"{s3_uri}/run{ext.replace('.', '-')}-{io_class.__name__}"
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=1, monitor=None)
    ckpt.FILE_EXTENSION = ext
    _fit(Tiny(seed=1), STOP, plugins=[io_class()], callbacks=[ckpt])
    path = f"{root}/epoch={STOP - 1}{ext}"
    assert ckptio.ls(root) == [path]  # the older one removed, after the newer was stored
    if ext != ".fpk":  # torch.load, as Lightning's own loader, reads what ckptio wrote
        assert torch.load(io.BytesIO(ckptio.get(path)), weights_only=False)["global_step"] == 4 * STOP

    resumed = Tiny(seed=2)  # different weights: all of them must come from the checkpoint
    trainer = _fit(resumed, EPOCHS, plugins=[io_class()], ckpt_path=path)
    model_sd, opt_sd, steps = uninterrupted
    assert trainer.global_step == steps
    _state_equal(model_sd, resumed.state_dict())
    _state_equal(opt_sd, trainer.optimizers[0].state_dict())


def test_async_save_failure_keeps_the_older_checkpoint_and_is_raised(tmp_path):
    plugin = CkptioAsyncCheckpointIO()
    old = str(tmp_path / "epoch=0.fpk")
    plugin.save_checkpoint({"w": torch.ones(3)}, old)
    (tmp_path / "file").write_text("not a directory")
    plugin.save_checkpoint({"w": torch.zeros(3)}, str(tmp_path / "file" / "epoch=1.fpk"))  # fails in the background
    with pytest.raises(OSError):
        plugin.remove_checkpoint(old)  # what ModelCheckpoint does next: refused, the save's error raised
    assert torch.equal(ckptio.load(old)["w"], torch.ones(3))
    plugin.teardown()


def test_async_save_copies_the_state_before_returning(tmp_path):
    plugin = CkptioAsyncCheckpointIO()
    w = torch.ones(1000)
    plugin.save_checkpoint({"w": w, "meta": {"step": 1}}, str(tmp_path / "a.fpk"))
    w.zero_()  # training goes on while the save is in flight
    plugin.teardown()
    assert torch.equal(ckptio.load(str(tmp_path / "a.fpk"))["w"], torch.ones(1000))


def test_load_runs_no_code_unless_weights_only_false(tmp_path):
    path = str(tmp_path / "a.pt")
    CkptioCheckpointIO().save_checkpoint({"hp": __import__("argparse").Namespace(lr=1)}, path)
    with pytest.raises(Exception, match="weights_only|allow"):
        CkptioCheckpointIO().load_checkpoint(path)
    assert CkptioCheckpointIO().load_checkpoint(path, weights_only=False)["hp"].lr == 1


def test_import_ckptio_does_not_import_lightning():
    code = (
        "import sys, ckptio, ckptio.integrations; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": ROOT})


def test_without_lightning_the_import_names_the_extra():
    code = (
        "import sys\n"
        "for m in ('lightning', 'lightning_fabric', 'pytorch_lightning'): sys.modules[m] = None\n"
        "try:\n    import ckptio.integrations.lightning\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
    )
    assert r.returncode == 0, r.stderr
    assert "MissingDependencyError" in r.stdout and "ckptio[lightning]" in r.stdout, r.stdout


def test_load_maps_to_the_cpu_by_default_as_lightning_does(tmp_path):
    path = str(tmp_path / "a.fpk")
    CkptioCheckpointIO().save_checkpoint({"w": torch.ones(2)}, path)
    seen = []
    CkptioCheckpointIO().load_checkpoint(path, map_location=lambda s, loc: seen.append(loc) or s)
    assert seen == ["cpu"] and CkptioCheckpointIO().load_checkpoint(path)["w"].device.type == "cpu"
