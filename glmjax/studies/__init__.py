"""Studies of offloaded decoding: the cost model (`cost_model`, calibrated by `cost_study` on
measured hardware, `cost_hardware`) with its GLM-5.2 prediction from published figures
(`glm52`, `published_figures.json`), and the registry of simulated and live studies behind
`scripts/negative_results.py` (`studies`, `live_studies`)."""
