from tests.trainer.conftest import arith_data, tiny_model  # noqa: F401  (the same session fixtures)
