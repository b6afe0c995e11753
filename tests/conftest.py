"""Suite-wide setup: a private model cache so the suite never touches ~/.cache."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory):
  os.environ["GLMJAX_CACHE"] = str(tmp_path_factory.mktemp("glmjax_cache"))
  yield
