"""The simulator: a training step (`train`) and serving (`serve_sim`) on a cluster from the hardware
catalog (`shiftlm.hardware`) and the engine's own `ModelConfig`; the planners (`planner`,
`serve_plan`); validation against published measurements (`validate`) and calibration of this
machine (`calibrate`, `serve_calibrate`). Torch-free.

The public modules (`shiftlm simulate|plan|calibrate` are `cli`, `serve_cli`, `validate_cli`)."""

__all__ = ["train", "serve_sim", "planner", "serve_plan", "layout", "memory", "costs", "collectives",
           "efficiency", "capabilities", "serve_runner", "validate", "calibrate", "serve_calibrate"]  # fmt: skip
