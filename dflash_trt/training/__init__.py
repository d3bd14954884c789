"""Training DFlash drafters (`dflash-trt train`).

- data.py: prompts -> the target's own responses (through the engine) -> a token dataset on disk
- objective.py: blocks at random anchors, the attention mask, the decayed per-slot loss
- drafter_files.py: a new drafter's config and first weights; trained weights in the z-lab layout
- trainer.py: the loop (DDP across processes), checkpoints and resume, the closing evaluation
"""
