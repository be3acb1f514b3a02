"""The public front: nginx's configuration (``nginx_config`` and ``templates/nginx.conf``), and the
request screen between nginx and tritonserver (``screen``, ``screen_server``)."""
