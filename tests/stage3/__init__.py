"""Stage 3: gathered units, their memory and communication, real loops and models,
whole-tensor ownership at stage 3, meta-device builds."""
