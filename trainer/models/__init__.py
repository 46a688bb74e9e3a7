"""The models a run trains and freezes: presets, loading, text encoding, pipelines, the tokenizer."""
