"""The carve stage, `moeify convert`: a dense FFN cut into experts, then (with --tune-tokens) the tune stage.

    conversion.py  the pipeline: plan (every check up front) -> per layer carve -> stream out -> verify
    calibrate.py   layer-sequential calibration: calibration tokens through the dense model, one layer resident
    carve.py       carving one layer: partition -> router -> (compensation)
    compensate.py  training-free compensation: down-projections refit under the carve's routing
"""
