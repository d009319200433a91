"""Training frameworks that drive a `GovernedRun`: `hf` (the Hugging Face Trainer and TRL's SFTTrainer)."""
