"""Training drafters: the response corpus, training windows, the losses, arguments and trainers (ChainFlow and
DFlash), offline evaluation, language adapters and complete-only checkpoints. See docs/layout.md for the map."""
