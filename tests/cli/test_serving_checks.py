"""What `selfrag serve` checks before Ray starts: the files its critique reads."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.redis_proc import free_port
from tests.suite import SUITE_ENV


@pytest.mark.real
def test_serve_refuses_a_heads_file_with_a_nan_weight_naming_it(
    normans_api_home: Path, tmp_path: Path
) -> None:
    """With `calibrate_on_first_use` off, such a server said ready while every answer was a 500
    (`HeadsError` in the branch pool)."""
    from selfrag.infra.models.heads_store import SHIPPED_DIR, heads_path
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.model_artefacts import model_artefacts

    home = tmp_path / "home"
    shutil.copytree(normans_api_home, home)
    sha = model_artefacts(load_settings(environ={"SELFRAG_HOME": str(home), **SUITE_ENV})).sha256
    doc = json.loads((SHIPPED_DIR / f"{sha}.json").read_text())
    group = doc["groups"]["support"]
    rows = np.frombuffer(base64.b64decode(group["float32_base64"]), dtype=np.float32).copy()
    rows[7] = np.nan
    group["float32_base64"] = base64.b64encode(rows.tobytes()).decode()
    bad = heads_path(home, sha)
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text(json.dumps(doc))
    cmd = [sys.executable, "-m", "selfrag.cli", "--home", str(home), "serve"]
    done = subprocess.run(
        [*cmd, "--port", str(free_port())], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0, done.stderr[-3000:]
    assert str(bad) in done.stderr and "not finite" in done.stderr
    assert "selfrag train" in done.stderr
    assert "Traceback" not in done.stderr and "serving at" not in done.stderr
