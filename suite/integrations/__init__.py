"""The arms plugged into other people's models: `suite.integrations.transformers` for Hugging Face
transformers >= 5 (the optional extra `[hf]`). The core package never imports these."""
