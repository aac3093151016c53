"""The command lines (argparse + main): dflash-train, -eval, -export, -prepare, -cache. Nothing else imports them."""
