"""`pdserve plan` and `pdserve profile`: capacity arithmetic and the P:D simulator."""
