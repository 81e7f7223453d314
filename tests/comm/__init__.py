"""What crosses ranks: devices and the device runtime, communication volume, ranks out of
step and timeouts, hybrid sharding, quantized collectives and error feedback."""
