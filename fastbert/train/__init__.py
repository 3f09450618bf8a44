"""Training: pretraining (pretrain.py and its helpers) and fine-tuning."""
