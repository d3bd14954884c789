"""`dflash-trt bench`: AR vs DFlash in process and through a server, the transformers
baseline, real-shape random weights and the shipped prompt sets."""
