"""The data every part of autopar shares, at the bottom of the layers (docs/architecture.md, "Layers"): the
captured training graph (`graph`), the plan (`plan`: strategy, pipelines, stages, predictions), the pipeline
schedules with their memory actions (`schedule`, checked by `schedule_check`, batched for NCCL by
`schedule_nccl`, in waves by `schedule_waves`), their simulators (`simulate`, `plan_simulate`), precision
(`precision`) and the lowered per-rank view (`lowered`). Nothing here imports anything above it."""
