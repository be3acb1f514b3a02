"""The running server: the launcher and what it supervises (tritonserver replicas, nginx, the
screen, the ``/v1`` frontend, stub watchdog), its state folder, control, drain, warm-up and health."""
