"""The MLflow tracking server the tracker tests share (one per test session, started by the first test that
asks for it)."""

from mlflow_server import tracking_server  # noqa: F401  (tests/, on sys.path under pytest; a fixture)
