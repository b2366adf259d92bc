"""The hub's files: each family's config.json and checkpoint layout, tokenizers, chat templates."""
