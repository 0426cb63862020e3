"""Formats and I/O, and the settings they are written with: shared by every stage and tool.

    experts.py     one carved FFN's tensors in a target format, and back (the export and its inverse)
    text.py        the text a command reads (calibration, --data, --eval) and the token windows it scores
    config.py      ConvertConfig: every setting of a conversion, from a TOML preset and flags; presets by name
    output.py      the output directory (written beside OUT, checked, renamed into place; OS errors as one line)
                   and the pipeline every stage writes through: staged_output, write_shards, write_metadata
    card.py        the model card every output carries (OUT/README.md)
    writer.py      checkpoint writing: size-capped shards, a background writer
    hub.py         sources by Hugging Face Hub id
    families.py    source families (llama, mistral, qwen2, qwen3) and target formats (mixtral, qwen2_moe, qwen3_moe)
    checkpoint.py  checkpoint reading: a lazy safetensors reader, names, dtypes
    engines.py     which serving engines run a planned output layout
    layout.py      preset layouts as shares of d_ff, resolved per model
"""
