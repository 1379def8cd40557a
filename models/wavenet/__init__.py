"""WaveNet-style autoregressive audio model (van den Oord et al. 2016) with fast sampling.

Files, laid out like Flax's examples: `configs/` (sizes and training settings), `model.py` (the
network and its math), `input_pipeline.py` (offline audio: espeak-ng speech and synthetic
signals), `train.py` (`train_and_evaluate`), `sampler.py` (naive, incremental and Python-loop
samplers), `pipeline_sampler.py` (layer-sharded over devices), `fused_sampler.py` (the fused C++
step), `audio.py` (mu-law, WAV, spectrogram) and `main.py` (the command line).
"""
