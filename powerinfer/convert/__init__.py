"""Converting Hugging Face checkpoints (and our own GGUF files) into GGUF and PowerInfer's PWRI layout.

Runs in: the CLI process (``powerinfer convert``) and tests. A tool: nothing at run time imports it.

    checkpoint.py  the HF folder: config.json, safetensors shards (parsed here), torch pickles (weights only)
    families.py    each model family's metadata and tensor names (llama/mistral, ProSparse, Bamboo, OPT)
    vocab.py       the tokenizer (tokenizer.json, or SentencePiece's tokenizer.model) and chat template as GGUF keys
    predictors.py  PowerInfer's predictor folders and our .predictor files, both ways
    writer.py      tensor types (f32/f16/q8_0/q4_0), the GGUF or PWRI file, written then renamed into place
"""
