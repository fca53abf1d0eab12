"""Training small ReLU-family models from scratch, so the sparse machinery has a real sparse model.

Runs in: the CLI process (``powerinfer train-relu``) and tests. A tool: the engine never imports it.

    corpus.py  public text installed from a package registry (Debian's python3.11-doc), split by file
    model.py   a llama-shaped decoder in torch with Hugging Face's names and semantics (any FFN activation)
    train.py   the deterministic recipe: tokenizer, model, AdamW steps, saving a Hugging Face folder
"""
