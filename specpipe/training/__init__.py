"""Training on the target's own answers: the scaffold `task=train_heads` and `task=distill_draft` share (the
corpus read and split into training and held-out answers, the resumable step loop with its checkpoints, evals
and exports, in `scaffold` and `examples`) and what each kind of drafter trains (`draft`; the heads' features
and shared rows in `features` and `heads`, one module per head kind: `eagle`, `eagle3`, `medusa`, run by
`head_run`). The tasks read the config; these modules take typed values."""
