API_KEY = "test-key"  # the integration mesh requires it
